// EMBEDCORE_HD marks math that is compiled for both the host and, in the CUDA
// build, the device: the combiners and optimizers are written once.
#pragma once

#if defined(__CUDACC__)
#define EMBEDCORE_HD __host__ __device__ __forceinline__
#else
#define EMBEDCORE_HD inline
#endif
