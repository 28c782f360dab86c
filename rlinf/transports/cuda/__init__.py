"""GPU transports. :mod:`.ipc`: CUDA IPC between processes of one node (pooled device
slots shared once, interprocess events for ordering); :class:`CudaIpcSession`: a
communicator's CUDA IPC state and what it keeps about each peer (:class:`CudaPeer`).
Imports no optional dependency until used."""

from ._session import CudaIpcSession, CudaPeer

__all__ = ["CudaIpcSession", "CudaPeer"]
