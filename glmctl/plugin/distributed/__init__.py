"""Host-staged collectives inside vLLM's tensor-parallel communicator (switch: GLMCTL_COLLECTIVES)
(vLLM: `distributed/device_communicators/`)."""
