from wanka.ops.moe_dispatch import reference  # noqa: F401
