"""Control plane over torch's distributed store: node agents publish what their ranks' heartbeat
files say, a coordinator reads it all from the store and decides. No host reads another's files.
"""
