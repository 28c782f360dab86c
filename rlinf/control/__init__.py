"""The control plane: the manager (:mod:`.manager`: registry over a ZeroMQ ROUTER plus
PUB events), the control client every worker runs (:mod:`.client`: registration,
heartbeats, lookups, events), the token-derived keys (:mod:`.security`) and node
identity and devices (:mod:`.devices`).

Layer: above ``transports``; below ``core``.
"""
