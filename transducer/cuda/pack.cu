// Packing the joiner input straight into the compact layout, and its backward (launched by
// transducer/cuda/stages.py: pack_forward / pack_backward). Both work on the rows [row_start, row_start + n)
// of the layout, so that the fused joiner loss (transducer/fused/__init__.py) can go tile by tile:
//
//   pack_forward_kernel            out[r - row_start] = dropout(act(a)), a = enc[b, t] + pred[b, u], for
//                                  row r = (b, t, u) (out's rows ld_out apart: the fused loss packs into a
//                                  wider matrix), then `ones` columns of ones (a bias's, the fused loss's GEMM
//                                  operand); out's rows past num_rows or past the layout's last row (to
//                                  out_rows) zeros in every column
//   pack_grad_kernel               grad_enc[b, t] += sum_{u <= U_b} d(b, t, u) in range   (t < T_b), and
//                                  scratch[b, frame block, u] = sum_{t in the block} d(b, t, u) in range; for
//                                  an utterance of more than u_chunk rows a frame, each chunk of u_chunk values
//                                  of u its own warps, their sums over u to enc_scratch
//   pack_grad_enc_kernel           grad_enc[b, t] += the chunks' sums in enc_scratch, in chunk order
//   pack_grad_pred_kernel          grad_pred[b, u] += sum over b's frame blocks of the scratch (u <= U_b)
//
// with d = grad_rows * mask * act'(a), a and h = act(a) recomputed as pack_forward_kernel computes them (the
// same h), or, for the identity without dropout, d = grad_rows: the fused joiner loss's activation, dropout
// and their backward ride on these passes instead of passes of their own, and the tile's hidden need not be
// kept (or read back: the input rows a pass reads besides grad_rows are few and stay in cache). The
// activations and the dropout mask: transducer/joiner.py (the same table and the same hash).
//
// The inputs may have different types (TE, TP: an fp32 encoder output beside a 16-bit predictor output
// under autocast): the sum and the activation are rounded to their promoted type P, as `enc + pred` and
// act compute them, and the forward writes the result in the GEMMs' type TO (16 bits under autocast), with
// no tile of type P. The backward reads each row of grad_rows once (both sums from one load, DESIGN.md: Both
// sums of pack's backward in one pass) and adds to its outputs, in P's accumulation type, in a fixed order:
// no atomics, the same sums every run.

#include "transducer/cuda/layout.cuh"
#include "transducer/cuda/row_pass.cuh"  // kThreads: pack_forward_kernel's and pack_grad_pred_kernel's block too

namespace td {
// transducer/joiner.py: ACTIVATIONS (each one's code)
enum Activation : int { kIdentity = 0, kTanh = 1, kRelu = 2, kSigmoid = 3, kGelu = 4, kSilu = 5, kLeakyRelu = 6 };

// activate and activation_slope take each code of enum Activation in a branch of its own; a code without one
// reaches the last branch, whose static_assert of this false constant stops the compilation
// (tests/test_kernels_compile.py instantiates the pack kernels for every activation of joiner.py's table).
template <int ACT>
constexpr bool kActivationWithoutCase = false;

// act(a). FAST: the result is rounded to a 16-bit type, whose half ulp (2^-9 at least) exceeds tanh.approx's
// error (2^-10.99, PTX ISA), so the one-instruction approximation (sm_75 and later) is as good there.
template <int ACT, bool FAST, typename A>
__device__ __forceinline__ A activate(A a) {
  if constexpr (ACT == kIdentity) {
    return a;
  } else if constexpr (ACT == kTanh) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 750
    if constexpr (FAST && sizeof(A) == 4) {
      float r;
      asm("tanh.approx.f32 %0, %1;" : "=f"(r) : "f"(a));
      return r;
    }
#endif
    return tanh(a);
  } else if constexpr (ACT == kRelu) {
    return a > A(0) ? a : A(0);
  } else if constexpr (ACT == kSigmoid) {
    return A(1) / (A(1) + exp(-a));
  } else if constexpr (ACT == kGelu) {
    return A(0.5) * a * (A(1) + erf(a * A(0.70710678118654752440)));
  } else if constexpr (ACT == kSilu) {
    return a / (A(1) + exp(-a));
  } else if constexpr (ACT == kLeakyRelu) {
    return a > A(0) ? a : a * A(0.01);  // transducer/joiner.py: LEAKY_RELU_SLOPE
  } else {
    static_assert(kActivationWithoutCase<ACT>, "activate: a code of enum Activation without its case");
  }
}

// act'(a), given a and h = act(a): from h where it gives it (tanh: 1 - h^2, relu: [h > 0], sigmoid:
// h (1 - h)), else from a (gelu: Phi(a) + a phi(a); silu: s + h (1 - s), s = sigmoid(a))
template <int ACT, typename A>
__device__ __forceinline__ A activation_slope(A a, A h) {
  if constexpr (ACT == kIdentity) {
    return A(1);
  } else if constexpr (ACT == kTanh) {
    return A(1) - h * h;
  } else if constexpr (ACT == kRelu) {
    return h > A(0) ? A(1) : A(0);
  } else if constexpr (ACT == kSigmoid) {
    return h * (A(1) - h);
  } else if constexpr (ACT == kGelu) {
    return A(0.5) * (A(1) + erf(a * A(0.70710678118654752440))) + a * exp(A(-0.5) * a * a) * A(0.39894228040143267794);
  } else if constexpr (ACT == kSilu) {
    const A sg = A(1) / (A(1) + exp(-a));
    return sg + h * (A(1) - sg);
  } else if constexpr (ACT == kLeakyRelu) {
    return h > A(0) ? A(1) : A(0.01);  // from h, as relu's
  } else {
    static_assert(kActivationWithoutCase<ACT>, "activation_slope: a code of enum Activation without its case");
  }
}

// The joiner's dropout (transducer/joiner.py: dropout_keep, the same arithmetic): element (row, col) is kept
// where h = fmix32(fmix32(row * 0x9E3779B1 ^ seed_lo) ^ col * 0x85EBCA77 ^ seed_hi) has h >> 8 >= threshold,
// and scaled by `scale` = 1 / (1 - p) (rounded to the hidden's type by the kernels, as the CPU twin's mask).
struct Dropout {
  unsigned int seed_lo;
  unsigned int seed_hi;
  unsigned int threshold;
  double scale;  // 1 / (1 - p), in double for float64 hiddens
};

__device__ __forceinline__ unsigned int fmix32(unsigned int h) {
  h ^= h >> 16;
  h *= 0x85ebca6bu;
  h ^= h >> 13;
  h *= 0xc2b2ae35u;
  return h ^ (h >> 16);
}

__device__ __forceinline__ bool dropout_keep(const Dropout& d, unsigned int row, unsigned int col) {
  const unsigned int h = fmix32(fmix32(row * 0x9e3779b1u ^ d.seed_lo) ^ (col * 0x85ebca77u) ^ d.seed_hi);
  return (h >> 8) >= d.threshold;
}

// x of type A rounded to type T and back
template <typename T, typename A>
__device__ __forceinline__ A round_to(A x) {
  typedef typename ops::AccOf<T>::type TA;
  return (A)ops::to_acc(ops::from_acc<T>((TA)x));
}

// act(e + p) for one vector of the joiner input, in P's accumulation type, rounded to P after the sum and
// after act: pack_forward writes it (in its output type), pack_grad recomputes it (bit for bit, given the
// same FAST). FAST: the GEMMs that take h, or give its gradient, are 16-bit, so tanh.approx is as good (see
// activate).
//
// Two inputs of one 16-bit type (P is that type) go two elements at a time (sm_90 for bf16, sm_80 for half): a
// packed fma(e, 1, p) (the sum rounded to P once, as the float sum rounded to P is), then the packed max with
// 0; fewer instructions, which bound the pack passes otherwise. tanh is taken in fp32 (tanh.approx.f32, then
// rounded to P): the packed tanh.approx.bf16x2 / f16x2 are less accurate than P's rounding, and shifted the
// loss of a bf16 step by 8x the unfused step's error.
template <typename A, typename B>
struct SameType {
  static constexpr bool value = false;
};
template <typename A>
struct SameType<A, A> {
  static constexpr bool value = true;
};

template <typename P>
struct Packed {  // the packed instructions of P, where the architecture has them
  static constexpr bool kOn = false;
};
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
template <>
struct Packed<ops::bf16_t> {
  static constexpr bool kOn = true;
  template <int ACT>
  static __device__ __forceinline__ unsigned int act(unsigned int e, unsigned int q) {
    unsigned int a;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(a) : "r"(e), "r"(0x3f803f80u), "r"(q));
    if (ACT == kRelu) asm("max.bf16x2 %0, %1, %2;" : "=r"(a) : "r"(a), "r"(0u));
    return a;
  }
  // lo and hi rounded to bf16 in one instruction (the low half lo's)
  static __device__ __forceinline__ unsigned int round(float lo, float hi) {
    unsigned int r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
  }
};
#endif
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
template <>
struct Packed<ops::half_t> {
  static constexpr bool kOn = true;
  template <int ACT>
  static __device__ __forceinline__ unsigned int act(unsigned int e, unsigned int q) {
    unsigned int a;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(a) : "r"(e), "r"(0x3c003c00u), "r"(q));
    if (ACT == kRelu) asm("max.f16x2 %0, %1, %2;" : "=r"(a) : "r"(a), "r"(0u));
    return a;
  }
  static __device__ __forceinline__ unsigned int round(float lo, float hi) {
    unsigned int r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
  }
};
#endif

// Whether joiner_input takes the packed path (and gives h's words in P)
template <typename P, typename TE, typename TP, int VEC, int ACT>
struct PackedInput {
  static constexpr bool value = SameType<TE, TP>::value && SameType<TE, P>::value && sizeof(P) == 2 &&
                                VEC % 2 == 0 && Packed<P>::kOn && (ACT == kIdentity || ACT == kTanh || ACT == kRelu);
};

template <int ACT, bool FAST, typename P, typename TE, typename TP, int VEC>
__device__ __forceinline__ void joiner_input(const ops::Vec<TE, VEC>& e, const ops::Vec<TP, VEC>& p,
                                             typename ops::AccOf<P>::type (&a)[VEC],
                                             typename ops::AccOf<P>::type (&h)[VEC], unsigned int* bits = nullptr) {
  typedef typename ops::AccOf<P>::type A;
  if constexpr (PackedInput<P, TE, TP, VEC, ACT>::value) {
    // a is not kept: these activations' slopes read h alone
    const unsigned int* pe = reinterpret_cast<const unsigned int*>(&e);
    const unsigned int* pp = reinterpret_cast<const unsigned int*>(&p);
#pragma unroll
    for (int j = 0; j < VEC / 2; ++j) {
      unsigned int w = Packed<P>::template act<ACT>(pe[j], pp[j]);
      P lo, hi;
      lo.bits = (unsigned short)(w & 0xffffu);
      hi.bits = (unsigned short)(w >> 16);
      if (ACT == kTanh) {  // both rounded by one conversion: conversions share a narrow pipe with tanh.approx
        w = Packed<P>::round(activate<kTanh, true>((float)ops::to_acc(lo)), activate<kTanh, true>((float)ops::to_acc(hi)));
        lo.bits = (unsigned short)(w & 0xffffu);
        hi.bits = (unsigned short)(w >> 16);
      }
      h[2 * j] = (A)ops::to_acc(lo);
      h[2 * j + 1] = (A)ops::to_acc(hi);
      if (bits != nullptr) bits[j] = w;  // h in P, two elements a word
    }
  } else {
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      a[j] = round_to<P>((A)ops::to_acc(e.v[j]) + (A)ops::to_acc(p.v[j]));
      h[j] = ACT == kIdentity ? a[j] : round_to<P>(activate<ACT, FAST || sizeof(P) == 2>(a[j]));
    }
  }
}

// x of accumulation type A in type T
template <typename T, typename A>
__device__ __forceinline__ T convert(A x) {
  return ops::from_acc<T>((typename ops::AccOf<T>::type)x);
}

// kPackRows consecutive rows per warp, each lane taking every 32nd vector of them: a warp finds the first row's
// (b, t, u) by the search and steps to the next rows (a search again only where a row starts another utterance),
// and has the rows' loads in flight together (DESIGN.md: Several rows per warp in pack_forward).
constexpr int kPackRows = 4;  // transducer/cuda/stages.py: PACK_ROWS
}  // namespace td

template <typename TE, typename TP, typename TO>
struct PackForwardParams {
  const TE* enc;   // (B, max_t, D)
  const TP* pred;  // (B, max_u1, D)
  int max_t;
  int max_u1;
  td::Grids grids;  // the compact layout
  int row_start;
  int num_rows;  // the layout's rows written, at most (those past the layout's last row zeros too)
  int out_rows;  // out's rows: those past num_rows zeros
  int nvec;      // D / VEC
  int ones;      // out's columns past D: ones in the layout's rows, zeros past them
  td::Dropout dropout;  // DROPOUT
  TO* out;
  long long ld_out;
};

// P: the promoted type of TE and TP
template <typename TE, typename TP, typename P, typename TO, int VEC, int ACT, bool DROPOUT>
__global__ void __launch_bounds__(td::kThreads) pack_forward_kernel(const PackForwardParams<TE, TP, TO> p) {
  using namespace ops;
  typedef typename AccOf<P>::type A;
  constexpr int R = td::kPackRows;
  const TE* __restrict__ enc = p.enc;
  const TP* __restrict__ pred = p.pred;
  TO* __restrict__ out = p.out;
  const int max_t = p.max_t, max_u1 = p.max_u1, nvec = p.nvec;
  const int lane = threadIdx.x & 31;
  const int first = (blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)) * R;
  if (first >= p.out_rows) return;
  const td::Grids& g = p.grids;
  // the rows the layout has from row_start on bound num_rows: the fused loss packs its first tile before the host
  // knows the row count (TilePath.begin_forward in transducer/fused/)
  const int num_rows = (int)min((long long)p.num_rows, max(0LL, g.split(g.B) - p.row_start));
  const long long D = (long long)nvec * VEC;
  int b = 0, t = 0, u = 0;
  long long end = 0, st = 1;
  if (first < num_rows) {
    g.coordinates(p.row_start + first, b, t, u);
    end = g.split(b + 1);  // the first row past utterance b
    st = g.stride(b);
  }
  const Vec<TE, VEC>* pe[R];
  const Vec<TP, VEC>* pp[R];
  // a row of out, one of the layout's rows; and a cell of the inputs (else zeros: inconsistent lengths)
  bool inside[R], real[R], cell[R];
#pragma unroll
  for (int k = 0; k < R; ++k) {
    const int r = p.row_start + first + k;
    inside[k] = first + k < p.out_rows;
    real[k] = first + k < num_rows;
    if (k > 0 && real[k]) {
      if (r < end) {
        if (++u >= st) u = 0, ++t;
      } else {
        g.coordinates(r, b, t, u);
        end = g.split(b + 1);
        st = g.stride(b);
      }
    }
    cell[k] = real[k] && t < max_t && u < max_u1;
    pe[k] = reinterpret_cast<const Vec<TE, VEC>*>(enc + ((long long)b * max_t + t) * D);
    pp[k] = reinterpret_cast<const Vec<TP, VEC>*>(pred + ((long long)b * max_u1 + u) * D);
  }
  for (int i = lane; i < nvec; i += 32) {
    Vec<TE, VEC> e[R];
    Vec<TP, VEC> q[R];
#pragma unroll
    for (int k = 0; k < R; ++k) {
      if (cell[k]) e[k] = ldg(pe[k] + i), q[k] = ldg(pp[k] + i);
    }
#pragma unroll
    for (int k = 0; k < R; ++k) {
      if (!inside[k]) continue;
      A a[VEC], h[VEC];
      // h's words as joiner_input rounded them, where they are the output: no conversion of the output's own
      constexpr bool kWords = td::PackedInput<P, TE, TP, VEC, ACT>::value && td::SameType<P, TO>::value && !DROPOUT;
      Vec<TO, VEC> words;  // the output vector, written word by word (kWords)
      if (cell[k]) {
        td::joiner_input<ACT, sizeof(TO) == 2, P>(e[k], q[k], a, h,
                                                  kWords ? reinterpret_cast<unsigned int*>(&words) : nullptr);
      } else {
#pragma unroll
        for (int j = 0; j < VEC; ++j) h[j] = A(0);
        if constexpr (kWords) {
#pragma unroll
          for (int j = 0; j < VEC / 2; ++j) reinterpret_cast<unsigned int*>(&words)[j] = 0u;
        }
      }
      if constexpr (kWords) {
        reinterpret_cast<Vec<TO, VEC>*>(out + (long long)(first + k) * p.ld_out)[i] = words;
        continue;
      }
      if (DROPOUT) {
        const A scale = td::round_to<P>((A)p.dropout.scale);
        const unsigned int row = (unsigned int)(p.row_start + first + k);
#pragma unroll
        for (int j = 0; j < VEC; ++j)
          h[j] = td::dropout_keep(p.dropout, row, (unsigned int)(i * VEC + j)) ? td::round_to<P>(h[j] * scale) : A(0);
      }
      Vec<TO, VEC> o;
      if constexpr (sizeof(TO) == 2 && VEC % 2 == 0 && td::Packed<TO>::kOn && td::SameType<A, float>::value) {
        unsigned int* w = reinterpret_cast<unsigned int*>(&o);  // two elements a conversion
#pragma unroll
        for (int j = 0; j < VEC / 2; ++j) w[j] = td::Packed<TO>::round(h[2 * j], h[2 * j + 1]);
      } else {
#pragma unroll
        for (int j = 0; j < VEC; ++j) o.v[j] = td::convert<TO>(h[j]);
      }
      reinterpret_cast<Vec<TO, VEC>*>(out + (long long)(first + k) * p.ld_out)[i] = o;
    }
  }
  for (int c = lane; c < p.ones; c += 32) {
#pragma unroll
    for (int k = 0; k < R; ++k) {
      if (inside[k]) out[(long long)(first + k) * p.ld_out + D + c] = td::convert<TO>(real[k] ? 1.0f : 0.0f);
    }
  }
}

namespace td {
// pack_grad_kernel's geometry: a warp takes a frame block of kSumFrames frames of one utterance, every u of them, and
// kSumLanes vectors of D: its lanes are 4 frames x kSumLanes vectors (lane = frame * 8 + vector), each lane kLaneFrames
// frames 4 apart, so that a row's kSumLanes vectors are one warp load and a block's sums over its frames meet in
// registers and shuffles, no barrier; kSumSteps values of u go together (their loads in flight). A block is
// kSumThreads / 32 warps, independent: consecutive frame blocks of one utterance (small blocks: a warp holds many
// registers, and the warps of a tile's few utterances must spread over the SMs).
constexpr int kSumThreads = 128;             // transducer/cuda/stages.py: PACK_SUM_THREADS
// blocks an SM holds at least: 5 (at most 96 registers a thread; more warps to hide the loads' latency) where dh and
// both inputs have one width of at most 4 bytes, else 4 (128 registers): any mix of widths (autocast's bf16 operand
// over fp32 inputs, an fp32 dh over a bf16 input) spills at 96, and double's sums take more (benchmarks/RESULTS.md:
// pack's backward's registers)
template <typename T, typename TE, typename TP>
constexpr int kSumMinBlocks = sizeof(T) == sizeof(TE) && sizeof(T) == sizeof(TP) && sizeof(T) <= 4 ? 5 : 4;
constexpr int kLaneFrames = 2;
constexpr int kSumFrames = 8;                // 4 * kLaneFrames; transducer/cuda/stages.py: PACK_FRAMES
constexpr int kSumLanes = 8;                 // transducer/cuda/stages.py: PACK_LANES
constexpr int kSumSteps = 2;
constexpr int kPredParts = 8;                // lanes a vector of pack_grad_pred_kernel; PACK_PRED_PARTS

// The frame blocks [lo, hi) of utterance b whose rows meet [row_start, row_end) (none where they do not), its rows
// per frame (U_b + 1) and frames, and the predictor rows each frame block sums into the scratch: min(U_b + 1, max_u1).
struct FrameBlocks {
  int lo, hi, rows_per_frame, frames, pred_rows;
  long long base, st;
  __device__ __forceinline__ FrameBlocks(const Grids& g, int b, long long row_start, long long row_end, int max_u1) {
    frames = (int)g.T(b);
    rows_per_frame = (int)g.U(b) + 1;
    base = g.split(b);
    st = g.stride(b);
    pred_rows = rows_per_frame < max_u1 ? rows_per_frame : max_u1;
    const long long first = row_start > base ? row_start : base;
    const long long end = base + (long long)frames * st, last = row_end < end ? row_end : end;
    lo = hi = 0;
    if (frames > 0 && st > 0 && rows_per_frame > 0 && first < last) {
      lo = (int)((first - base) / (kSumFrames * st));
      hi = (int)((last - 1 - base) / (kSumFrames * st)) + 1;
    }
  }
};

// The scratch row of (utterance b, frame block lo_b) (pack_grad_kernel writes, pack_grad_pred_kernel reads): b's
// first row of the rows, over kSumFrames, plus 2 max_u1 + 1 rows for each utterance of the rows before it. b's frame
// blocks need at most (its rows among the rows) / kSumFrames + 2 max_u1 scratch rows (the blocks whole within the
// rows hold kSumFrames * st rows each, pred_rows <= st, max_u1; two more at the ends), so that utterances never meet
// and the rows [row_start, row_end) of utterances [b0, b1) need at most ceil((row_end - row_start) / kSumFrames) +
// (b1 - b0) (2 max_u1 + 1) scratch rows (transducer/cuda/stages.py sizes it so).
__device__ __forceinline__ long long scratch_row(const FrameBlocks& f, int b0, int b, long long row_start,
                                                 int max_u1) {
  const long long rows_before = f.base > row_start ? f.base - row_start : 0;
  return rows_before / kSumFrames + (long long)(b - b0) * (2 * max_u1 + 1);
}

// The chunks of u of pack_grad_kernel's grid (its z): max_u1 in chunks of u_chunk values (1: u_chunk = 0, no split).
__device__ __forceinline__ int grid_chunks(int u_chunk, int max_u1) {
  return u_chunk > 0 && max_u1 > u_chunk ? (max_u1 + u_chunk - 1) / u_chunk : 1;
}

// The chunks that utterance b's rows per frame fall in (1: not split), at most the grid's `chunks` (the last takes
// the rest of u).
__device__ __forceinline__ int u_chunks(const FrameBlocks& f, int u_chunk, int chunks) {
  if (chunks <= 1) return 1;
  const int n = (f.rows_per_frame + u_chunk - 1) / u_chunk;
  return n < chunks ? (n > 1 ? n : 1) : chunks;
}

// The enc_scratch row of (utterance b, frame block lo_b, chunk 0, the block's frame 0) (pack_grad_kernel writes,
// pack_grad_enc_kernel reads), for an utterance of n > 1 chunks: its frame blocks' rows, frame block by frame
// block, n chunks of kSumFrames rows each. A chunk holds u_chunk values of u (rows_per_frame > u_chunk), so that
// b's (at most) R_b / (kSumFrames rows_per_frame) + 2 frame blocks among its R_b rows of the rows need at most
// 2 R_b / u_chunk + 16 n <= 2 R_b / u_chunk + 16 chunks rows; placed 2 rows_before / u_chunk + (b - b0) (16 chunks +
// 1) on, the rows of utterances [b0, b1) need at most 2 (row_end - row_start) / u_chunk + (b1 - b0) (16 chunks + 1)
// (transducer/cuda/stages.py sizes it so).
__device__ __forceinline__ long long enc_scratch_row(const FrameBlocks& f, int b0, int b, long long row_start,
                                                     int u_chunk, int chunks) {
  const long long rows_before = f.base > row_start ? f.base - row_start : 0;
  return 2 * rows_before / u_chunk + (long long)(b - b0) * (16 * chunks + 1);
}
}  // namespace td

template <typename T, typename TE, typename TP, typename S, typename O>
struct PackGradParams {
  const T* grad_rows;  // the rows [row_start, row_end), D wide
  const TE* enc;       // (B, max_t, D): read for an activation only
  const TP* pred;      // (B, max_u1, D)
  int max_t;
  int max_u1;
  td::Grids grids;
  int b0;             // the first of the utterances whose rows meet the rows
  int frame_blocks;   // pack_grad_kernel's warps per utterance (a multiple of kSumThreads / 32)
  int u_chunk;        // the values of u a warp of pack_grad_kernel takes (grid z: its chunks), 0: all of them
  int pred_blocks;    // pack_grad_pred_kernel's blocks per utterance
  int enc_blocks;     // pack_grad_enc_kernel's blocks per utterance
  int row_start;
  int row_end;
  int nvec;           // D / VEC
  td::Dropout dropout;  // DROPOUT
  S* scratch;         // the predictor sums of each frame block (td::scratch_row), D wide
  S* enc_scratch;     // the encoder sums of each frame and chunk of u (td::enc_scratch_row), D wide
  O* grad_enc;        // (B, max_t, D)
  O* grad_pred;       // (B, max_u1, D)
};

// One pass over the rows [row_start, row_end) (grad_rows holding them) of utterances [b0, ...): d = grad_rows *
// mask * act'(a), a and h recomputed from enc and pred (a row whose t or u lies past them, possible with unchecked
// lengths, had a = h = 0 in forward, as here); grad_enc[b, t] += sum_u d(b, t, u), whole, where a warp holds every u
// of its frames, else each chunk's sum to enc_scratch, which pack_grad_enc_kernel then adds into grad_enc[b, t] in
// chunk order; the sums over a frame block's frames of d(b, t, u) go to the scratch, whose rows
// pack_grad_pred_kernel then adds into grad_pred[b, u] in frame block order. Sums in a fixed order (deterministic):
// a lane's frames in registers, the warp's 4 lanes of a vector by shuffles. Warp w of block (x, y, z): utterance
// b0 + x / blocks_per_b, its frame blocks lo + (x % blocks_per_b) * W + w + k * frame_blocks, the vectors
// [y * kSumLanes, (y + 1) * kSumLanes), the u of chunk z (all of them when the utterance has one). P: the promoted
// type of TE and TP. (Chunks of u give a tile of few long utterances, whose frame blocks are few, warps enough to
// fill the GPU.)
template <typename T, typename TE, typename TP, typename P, typename O, int VEC, int ACT, bool DROPOUT>
__global__ void __launch_bounds__(td::kSumThreads, td::kSumMinBlocks<T, TE, TP>) pack_grad_kernel(
    const PackGradParams<T, TE, TP, typename ops::AccOf<P>::type, O> p) {
  using namespace ops;
  typedef typename AccOf<P>::type Acc;
  constexpr int W = td::kSumThreads / 32, F = td::kLaneFrames, S = td::kSumSteps;
  static_assert(td::kSumLanes * 4 == 32 && td::kSumFrames == 4 * F, "a warp is 4 lanes x kSumLanes vectors");
  const T* __restrict__ grad_rows = p.grad_rows;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, vec = lane & (td::kSumLanes - 1), sub = lane >> 3;
  const int blocks_per_b = (p.frame_blocks + W - 1) / W;
  const int b = p.b0 + (int)blockIdx.x / blocks_per_b;
  const td::Grids& g = p.grids;
  const td::FrameBlocks f(g, b, p.row_start, p.row_end, p.max_u1);
  const long long D = (long long)p.nvec * VEC;
  const int i = (int)blockIdx.y * td::kSumLanes + vec;  // the lane's vector
  const bool live_vec = i < p.nvec;
  const long long first_row = td::scratch_row(f, p.b0, b, p.row_start, p.max_u1);
  const int all_chunks = td::grid_chunks(p.u_chunk, p.max_u1);
  const int chunks = td::u_chunks(f, p.u_chunk, all_chunks), z = (int)blockIdx.z;
  if (z >= chunks) return;  // uniform over the block: no u of this utterance in chunk z
  const int u_lo = chunks > 1 ? z * p.u_chunk : 0;
  const int u_hi = chunks > 1 && z + 1 < chunks ? u_lo + p.u_chunk : f.rows_per_frame;
  const Acc scale = DROPOUT ? td::round_to<P>((Acc)p.dropout.scale) : Acc(1);
  for (int fb = f.lo + ((int)blockIdx.x % blocks_per_b) * W + warp; fb < f.hi; fb += p.frame_blocks) {
    int t[F];
    bool live[F];
    long long row0[F];  // the row of (t, 0)
    Vec<TE, VEC> e[F];
    Acc acc[F][VEC];
#pragma unroll
    for (int m = 0; m < F; ++m) {
      t[m] = fb * td::kSumFrames + 4 * m + sub;
      live[m] = live_vec && t[m] < f.frames;
      row0[m] = f.base + (long long)t[m] * f.st;
      if (ACT != td::kIdentity && live[m] && t[m] < p.max_t)
        e[m] = ldg(reinterpret_cast<const Vec<TE, VEC>*>(p.enc + ((long long)b * p.max_t + t[m]) * D) + i);
#pragma unroll
      for (int j = 0; j < VEC; ++j) acc[m][j] = Acc(0);
    }
    Acc* scratch = p.scratch + (first_row + (long long)(fb - f.lo) * f.pred_rows) * D + (long long)i * VEC;
    for (int u0 = u_lo; u0 < u_hi; u0 += S) {
      Vec<T, VEC> x[S][F];
      Vec<TP, VEC> q[S];
      bool in[S][F];
#pragma unroll
      for (int k = 0; k < S; ++k) {
        const int u = u0 + k;
#pragma unroll
        for (int m = 0; m < F; ++m) {
          const long long r = row0[m] + u;
          in[k][m] = live[m] && u < u_hi && r >= p.row_start && r < p.row_end;
          if (in[k][m]) x[k][m] = ldg(reinterpret_cast<const Vec<T, VEC>*>(grad_rows + (r - p.row_start) * D) + i);
        }
        if (ACT != td::kIdentity && live_vec && u < p.max_u1 && u < u_hi)
          q[k] = ldg(reinterpret_cast<const Vec<TP, VEC>*>(p.pred + ((long long)b * p.max_u1 + u) * D) + i);
      }
#pragma unroll
      for (int k = 0; k < S; ++k) {
        const int u = u0 + k;
        Acc sum[VEC];
#pragma unroll
        for (int j = 0; j < VEC; ++j) sum[j] = Acc(0);
#pragma unroll
        for (int m = 0; m < F; ++m) {
          if (!in[k][m]) continue;
          Acc slope[VEC];
#pragma unroll
          for (int j = 0; j < VEC; ++j) slope[j] = Acc(1);
          if (ACT != td::kIdentity) {
            Acc a[VEC], h[VEC];
            if (t[m] < p.max_t && u < p.max_u1) {
              td::joiner_input<ACT, sizeof(T) == 2, P>(e[m], q[k], a, h);
            } else {
#pragma unroll
              for (int j = 0; j < VEC; ++j) a[j] = h[j] = Acc(0);
            }
#pragma unroll
            for (int j = 0; j < VEC; ++j) slope[j] = td::activation_slope<ACT>(a[j], h[j]);
          }
          if (DROPOUT) {
            const unsigned int row = (unsigned int)(row0[m] + u);
#pragma unroll
            for (int j = 0; j < VEC; ++j)
              slope[j] = td::dropout_keep(p.dropout, row, (unsigned int)(i * VEC + j)) ? slope[j] * scale : Acc(0);
          }
#pragma unroll
          for (int j = 0; j < VEC; ++j) {
            const Acc d = ACT == td::kIdentity && !DROPOUT ? (Acc)to_acc(x[k][m].v[j])
                                                           : (Acc)to_acc(x[k][m].v[j]) * slope[j];
            acc[m][j] += d;
            sum[j] += d;
          }
        }
        // the warp's 4 lanes of the vector (lanes vec, vec + 8, vec + 16, vec + 24)
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          sum[j] += __shfl_xor_sync(0xffffffffu, sum[j], 8);
          sum[j] += __shfl_xor_sync(0xffffffffu, sum[j], 16);
        }
        if (sub == 0 && live_vec && u < f.pred_rows && u < u_hi) {
#pragma unroll
          for (int j = 0; j < VEC; ++j) scratch[u * D + j] = sum[j];
        }
      }
    }
    if (chunks > 1) {  // this chunk's sums over u, for pack_grad_enc_kernel
      Acc* enc_sums = p.enc_scratch + (td::enc_scratch_row(f, p.b0, b, p.row_start, p.u_chunk, all_chunks) +
                                       ((long long)(fb - f.lo) * chunks + z) * td::kSumFrames) * D + (long long)i * VEC;
#pragma unroll
      for (int m = 0; m < F; ++m) {
        if (!live_vec) continue;
        Vec<Acc, VEC> o;
#pragma unroll
        for (int j = 0; j < VEC; ++j) o.v[j] = acc[m][j];
        *reinterpret_cast<Vec<Acc, VEC>*>(enc_sums + (4 * m + sub) * D) = o;
      }
      continue;
    }
    // each frame's sum over u, whole: added where the frame has rows in range
#pragma unroll
    for (int m = 0; m < F; ++m) {
      if (live[m] && t[m] < p.max_t && row0[m] + f.rows_per_frame > p.row_start && row0[m] < p.row_end) {
        Vec<O, VEC>* out = reinterpret_cast<Vec<O, VEC>*>(p.grad_enc + ((long long)b * p.max_t + t[m]) * D) + i;
        Vec<O, VEC> o = *out;
#pragma unroll
        for (int j = 0; j < VEC; ++j) o.v[j] = td::convert<O>((Acc)to_acc(o.v[j]) + acc[m][j]);
        *out = o;
      }
    }
  }
}

// grad_enc[b, t] += the enc_scratch rows of (b, t) over the chunks of u, in chunk order, for the utterances of more
// than one chunk (the others' sums went to grad_enc whole): a thread a vector of a frame; block x: utterance b0 + x /
// enc_blocks, its (frame from b's first frame block's first, vector) from (x % enc_blocks) * kThreads. A frame is
// added where it has rows in range, as pack_grad_kernel adds it.
template <typename T, typename TE, typename TP, typename P, typename O, int VEC>
__global__ void __launch_bounds__(td::kThreads) pack_grad_enc_kernel(
    const PackGradParams<T, TE, TP, typename ops::AccOf<P>::type, O> p) {
  using namespace ops;
  typedef typename AccOf<P>::type Acc;
  const long long id = (long long)(blockIdx.x % p.enc_blocks) * td::kThreads + threadIdx.x;  // frame * nvec + i
  const int b = p.b0 + (int)(blockIdx.x / p.enc_blocks), i = (int)(id % p.nvec);
  const td::Grids& g = p.grids;
  const td::FrameBlocks f(g, b, p.row_start, p.row_end, p.max_u1);
  const int all_chunks = td::grid_chunks(p.u_chunk, p.max_u1);
  const int chunks = td::u_chunks(f, p.u_chunk, all_chunks);
  const long long k = id / p.nvec;  // the frame from the first frame block's first
  const int t = f.lo * td::kSumFrames + (int)k;
  if (chunks <= 1 || k >= (long long)(f.hi - f.lo) * td::kSumFrames || t >= f.frames || t >= p.max_t) return;
  const long long row0 = f.base + (long long)t * f.st;
  if (row0 + f.rows_per_frame <= p.row_start || row0 >= p.row_end) return;
  const long long D = (long long)p.nvec * VEC;
  const int fb = (int)(k / td::kSumFrames), frame = (int)(k % td::kSumFrames);
  const Acc* sums = p.enc_scratch + (td::enc_scratch_row(f, p.b0, b, p.row_start, p.u_chunk, all_chunks) +
                                     (long long)fb * chunks * td::kSumFrames + frame) * D + (long long)i * VEC;
  Acc v[VEC];
#pragma unroll
  for (int j = 0; j < VEC; ++j) v[j] = Acc(0);
  for (int z = 0; z < chunks; ++z) {
    const Vec<Acc, VEC> s = ldg(reinterpret_cast<const Vec<Acc, VEC>*>(sums + (long long)z * td::kSumFrames * D));
#pragma unroll
    for (int j = 0; j < VEC; ++j) v[j] += s.v[j];
  }
  Vec<O, VEC>* out = reinterpret_cast<Vec<O, VEC>*>(p.grad_enc + ((long long)b * p.max_t + t) * D) + i;
  Vec<O, VEC> o = *out;
#pragma unroll
  for (int j = 0; j < VEC; ++j) o.v[j] = td::convert<O>((Acc)to_acc(o.v[j]) + v[j]);
  *out = o;
}

// grad_pred[b, u] += the scratch rows of (b, u) over b's frame blocks that meet the rows: kPredParts lanes a vector of
// a predictor row, lane l adding the frame blocks l, l + kPredParts, ... in order, the lanes' sums then meeting by
// shuffles in a fixed order (the loads of a long utterance's many frame blocks in flight together); block x: utterance
// b0 + x / pred_blocks, its (u, vector, lane) from (x % pred_blocks) * kThreads.
template <typename T, typename TE, typename TP, typename P, typename O, int VEC>
__global__ void __launch_bounds__(td::kThreads) pack_grad_pred_kernel(
    const PackGradParams<T, TE, TP, typename ops::AccOf<P>::type, O> p) {
  using namespace ops;
  typedef typename AccOf<P>::type Acc;
  constexpr int L = td::kPredParts;
  const long long id = ((long long)(blockIdx.x % p.pred_blocks) * td::kThreads + threadIdx.x) / L;  // u * nvec + i
  const int part = (int)threadIdx.x % L;
  const int b = p.b0 + (int)(blockIdx.x / p.pred_blocks), i = (int)(id % p.nvec);
  const int u = id / p.nvec < p.max_u1 ? (int)(id / p.nvec) : p.max_u1;  // max_u1: no row (the lanes stay for the shuffles)
  const td::Grids& g = p.grids;
  const td::FrameBlocks f(g, b, p.row_start, p.row_end, p.max_u1);
  const bool live = u < f.pred_rows;
  const long long D = (long long)p.nvec * VEC;
  const Vec<Acc, VEC>* scratch = reinterpret_cast<const Vec<Acc, VEC>*>(
      p.scratch + (td::scratch_row(f, p.b0, b, p.row_start, p.max_u1) + (live ? u : 0)) * D) + i;
  const long long stride = (long long)f.pred_rows * p.nvec;  // vectors from a frame block's row to the next's
  Acc v[VEC];
#pragma unroll
  for (int j = 0; j < VEC; ++j) v[j] = Acc(0);
  const int n = live ? f.hi - f.lo : 0;
  int k = part;
  for (; k + L < n; k += 2 * L) {
    const Vec<Acc, VEC> s0 = ldg(scratch + k * stride), s1 = ldg(scratch + (k + L) * stride);
#pragma unroll
    for (int j = 0; j < VEC; ++j) v[j] += s0.v[j], v[j] += s1.v[j];
  }
  if (k < n) {
    const Vec<Acc, VEC> s0 = ldg(scratch + k * stride);
#pragma unroll
    for (int j = 0; j < VEC; ++j) v[j] += s0.v[j];
  }
#pragma unroll
  for (int m = L / 2; m > 0; m /= 2)
#pragma unroll
    for (int j = 0; j < VEC; ++j) v[j] += __shfl_xor_sync(0xffffffffu, v[j], m);
  if (!live || part != 0) return;
  Vec<O, VEC>* out = reinterpret_cast<Vec<O, VEC>*>(p.grad_pred + ((long long)b * p.max_u1 + u) * D) + i;
  Vec<O, VEC> o = *out;
#pragma unroll
  for (int j = 0; j < VEC; ++j) o.v[j] = td::convert<O>((Acc)to_acc(o.v[j]) + v[j]);
  *out = o;
}
