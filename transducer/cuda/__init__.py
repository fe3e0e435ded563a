"""The CUDA backend: the stages of transducer/backend.py's contract (stages.py) launching the kernels of the .cu
sources beside it, which share the .cuh headers here and those of ops/ and ragged/."""
