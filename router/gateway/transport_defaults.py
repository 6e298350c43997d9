"""Defaults of the gateway's transport bounds, shared by `GatewaySettings` and `BatonConfig`
(which documents their reasons); a module of constants, so the config imports nothing more."""

# A 4 MiB body (max_body_bytes' default) takes 30 s at 140 kB/s, a poor mobile uplink:
# slower than that, a client holds a gateway slot rather than sending a request.
BODY_READ_TIMEOUT_S = 30.0
