"""GPU transports. :mod:`.ipc`: CUDA IPC between processes of one node (pooled device
slots shared once, interprocess events for ordering). Imports no optional dependency
until used."""
