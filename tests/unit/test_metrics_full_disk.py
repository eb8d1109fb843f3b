"""A disk that fills up mid-run costs a metrics row, not the run (a rank died writing its
metrics, found by an attacker): the file is cut back to its last whole line, and later rows
are written again once there is room."""

import errno
import io
import json
import os

from wanka.train.metrics import METRICS_FILE, MetricsWriter


class _FullOnce:
    """A metrics file whose first flush writes a torn row and fails with ENOSPC."""

    def __init__(self, real):
        self.real, self.pending, self.failed = real, "", False

    def fileno(self):
        return self.real.fileno()

    def write(self, text):
        self.pending += text

    def flush(self):
        if not self.failed:
            self.failed = True
            os.write(self.real.fileno(), self.pending[:9].encode())  # part of it made it out
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.real.write(self.pending)
        self.real.flush()
        self.pending = ""

    def close(self):
        self.real.close()


def test_a_full_disk_loses_the_row_not_the_run(tmp_path, capsys):
    w = MetricsWriter(tmp_path, True, 3, tensorboard=False, stream=io.StringIO())
    w.log_train(1, {"loss": 1.0})
    w._file = _FullOnce(w._file)
    w.log_train(2, {"loss": 2.0})  # the disk is full: no exception
    w.log_event("resume", 2)
    w.log_train(3, {"loss": 3.0})
    w.close()
    rows = [json.loads(x) for x in (tmp_path / METRICS_FILE).read_text().splitlines()]
    assert [(r["kind"], r["step"]) for r in rows] == [("train", 1), ("resume", 2), ("train", 3)]
    err = capsys.readouterr().err
    assert err.count("metrics not written") == 1 and "No space left" in err
