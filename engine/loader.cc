#include "engine/loader.h"

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cmath>
#include <fstream>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/aligned_buffer.h"
#include "common/status.h"
#include "common/thread_pool.h"
#include "cpu_moe/cpu_moe.h"
#include "engine/safetensors.h"
#include "moe_cache/gpu/bank_layout.h"
#include "moe_cache/gpu/expert_store.h"
#include "nlohmann/json.hpp"

namespace moe::engine {
namespace {

using common::WeightFormat;
constexpr int64_t kFp8Block = common::kFp8BlockSize;

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

std::string ShapeStr(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

float ScalarToFloat(StDtype dtype, const uint8_t* p) {
  switch (dtype) {
    case StDtype::kF32: {
      float f;
      std::memcpy(&f, p, 4);
      return f;
    }
    case StDtype::kBf16: {
      uint16_t h;
      std::memcpy(&h, p, 2);
      return common::Bf16ToFloat(h);
    }
    case StDtype::kF16: {
      uint16_t h;
      std::memcpy(&h, p, 2);
      return common::Fp16ToFloat(h);
    }
    case StDtype::kF8E4M3:
      return common::Fp8E4M3ToFloat(*p);
    default:
      return 0.0f;  // excluded by CheckFloatDtype
  }
}

// A [rows, cols] matrix in a checkpoint: a whole 2-D tensor (or a 1-D one as one row), or one
// expert's rows of a fused 3-D tensor. F8_E4M3 matrices carry their 128x128 block scales
// ([ceil(rows/128), ceil(cols/128)], real = fp8 * scale_inv). NVFP4 matrices (ModelOpt's export,
// dtype U8) are [rows, cols / 2] bytes of e2m1 codes, element 2i in the low nibble of byte i
// and 2i + 1 in the high one, with e4m3 scales per 16 elements of a row ([rows, cols / 16],
// `weight_scale`) and one fp32 scale per tensor (`weight_scale_2`): real = e2m1 * e4m3 * global.
// A view into the checkpoint's mapping (owns nothing); its methods are const and may run on any
// number of threads.
struct MatrixSource {
  const StTensor* tensor = nullptr;
  const uint8_t* data = nullptr;
  int64_t rows = 0, cols = 0;
  StDtype dtype = StDtype::kF32;
  const StTensor* scale_inv = nullptr;
  const uint8_t* block_scales = nullptr;  // NVFP4: e4m3 [rows, cols / 16]
  float global_scale = 1.0f;              // NVFP4: weight_scale_2

  bool is_fp8() const { return dtype == StDtype::kF8E4M3; }
  bool is_nvfp4() const { return dtype == StDtype::kU8; }

  // Row r as floats.
  void RowToFloat(int64_t r, float* out) const {
    if (is_nvfp4()) {
      const uint8_t* row = data + r * (cols / 2);
      const uint8_t* sc = block_scales + r * (cols / common::kNvfp4Block);
      for (int64_t c = 0; c < cols; ++c) {
        const uint8_t code = c % 2 == 0 ? row[c / 2] & 0xF : row[c / 2] >> 4;
        out[c] = common::Fp4E2M1ToFloat(code) *
                 common::Fp8E4M3ToFloat(sc[c / common::kNvfp4Block]) * global_scale;
      }
      return;
    }
    const int esize = StDtypeSize(dtype);
    const uint8_t* row = data + r * cols * esize;
    switch (dtype) {
      case StDtype::kF32:
        std::memcpy(out, row, cols * sizeof(float));
        return;
      case StDtype::kBf16:
        for (int64_t c = 0; c < cols; ++c) out[c] = ScalarToFloat(StDtype::kBf16, row + 2 * c);
        return;
      case StDtype::kF16:
        for (int64_t c = 0; c < cols; ++c) out[c] = ScalarToFloat(StDtype::kF16, row + 2 * c);
        return;
      case StDtype::kF8E4M3: {
        const int64_t scols = CeilDiv(cols, kFp8Block);
        const int ssize = StDtypeSize(scale_inv->dtype);
        const uint8_t* srow = scale_inv->data + (r / kFp8Block) * scols * ssize;
        for (int64_t cb = 0; cb < scols; ++cb) {
          const float s = ScalarToFloat(scale_inv->dtype, srow + cb * ssize);
          const int64_t end = std::min(cols, (cb + 1) * kFp8Block);
          for (int64_t c = cb * kFp8Block; c < end; ++c) {
            out[c] = common::Fp8E4M3ToFloat(row[c]) * s;
          }
        }
        return;
      }
      default:
        std::fill(out, out + cols, 0.0f);
    }
  }

  // Rows [0, rows) into bf16 bits; bit-exact copies of BF16 sources.
  void ToBf16(uint16_t* out, float* row_scratch) const {
    if (dtype == StDtype::kBf16) {
      std::memcpy(out, data, rows * cols * 2);
      return;
    }
    for (int64_t r = 0; r < rows; ++r) {
      RowToFloat(r, row_scratch);
      for (int64_t c = 0; c < cols; ++c) out[r * cols + c] = common::FloatToBf16(row_scratch[c]);
    }
  }

  void ToFloat(float* out) const {
    for (int64_t r = 0; r < rows; ++r) RowToFloat(r, out + r * cols);
  }
};

// Looks tensors up with the checks every model file needs. Borrows the checkpoint, which must
// outlive it and the MatrixSources it returns; const after construction, so thread-compatible.
class TensorFinder {
 public:
  // nvfp4: the checkpoint declares NVFP4 quantization (ReadQuantization), so U8 matrices are
  // NVFP4 codes.
  TensorFinder(const Checkpoint& ckpt, bool nvfp4) : ckpt_(ckpt), nvfp4_(nvfp4) {}

  bool Has(const std::string& name) const { return ckpt_.Find(name) != nullptr; }

  // The tensor `name` with exactly `shape` (a vector of n may also be spelled [1, n] when
  // allow_row is set) and a float dtype.
  absl::StatusOr<MatrixSource> Matrix(const std::string& name, int64_t rows, int64_t cols,
                                      bool vector) const {
    const StTensor* t = ckpt_.Find(name);
    if (t == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat(ckpt_.description(), ": tensor \"", name, "\" is missing"));
    }
    if (t->dtype == StDtype::kU8) {
      if (nvfp4_ && !vector) return Nvfp4Matrix(*t, name, rows, cols);
      RETURN_IF_ERROR(CheckDtype(*t, /*allow_fp8=*/true));
    }
    const std::vector<int64_t> want =
        vector ? std::vector<int64_t>{cols} : std::vector<int64_t>{rows, cols};
    if (t->shape != want) {
      return absl::InvalidArgumentError(absl::StrCat(*t->file, ": tensor \"", name, "\" has shape ",
                                                     ShapeStr(t->shape), ", expected ",
                                                     ShapeStr(want)));
    }
    MatrixSource s;
    s.tensor = t;
    s.data = t->data;
    s.rows = rows;
    s.cols = cols;
    s.dtype = t->dtype;
    RETURN_IF_ERROR(CheckDtype(*t, /*allow_fp8=*/true));
    if (s.is_fp8()) RETURN_IF_ERROR(AttachScales(name, &s));
    return s;
  }

  // A depthwise conv weight [rows, 1, cols] (as torch's Conv1d stores it; [rows, cols] is
  // accepted too) as a [rows, cols] matrix.
  absl::StatusOr<MatrixSource> Conv(const std::string& name, int64_t rows, int64_t cols) const {
    const StTensor* t = ckpt_.Find(name);
    if (t == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat(ckpt_.description(), ": tensor \"", name, "\" is missing"));
    }
    if (t->shape != std::vector<int64_t>{rows, 1, cols} &&
        t->shape != std::vector<int64_t>{rows, cols}) {
      return absl::InvalidArgumentError(
          absl::StrCat(*t->file, ": tensor \"", name, "\" has shape ", ShapeStr(t->shape),
                       ", expected ", ShapeStr({rows, 1, cols}), " (channels, 1, kernel)"));
    }
    RETURN_IF_ERROR(CheckDtype(*t, /*allow_fp8=*/false));
    MatrixSource s;
    s.tensor = t;
    s.data = t->data;
    s.rows = rows;
    s.cols = cols;
    s.dtype = t->dtype;
    return s;
  }

  // One expert's [rows, cols] slice starting at row `row0` of a fused [E, R, cols] tensor.
  absl::StatusOr<const StTensor*> Fused(const std::string& name,
                                        const std::vector<int64_t>& shape) const {
    const StTensor* t = ckpt_.Find(name);
    if (t == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat(ckpt_.description(), ": tensor \"", name, "\" is missing"));
    }
    if (t->shape != shape) {
      return absl::InvalidArgumentError(absl::StrCat(
          *t->file, ": tensor \"", name, "\" has shape ", ShapeStr(t->shape), ", expected ",
          ShapeStr(shape), " (experts, rows = out features, columns = in features)"));
    }
    RETURN_IF_ERROR(CheckDtype(*t, /*allow_fp8=*/false));
    return t;
  }

 private:
  absl::Status CheckDtype(const StTensor& t, bool allow_fp8) const {
    const bool ok = t.dtype == StDtype::kF32 || t.dtype == StDtype::kBf16 ||
                    t.dtype == StDtype::kF16 || (allow_fp8 && t.dtype == StDtype::kF8E4M3);
    if (!ok) {
      return absl::InvalidArgumentError(absl::StrCat(
          *t.file, ": tensor \"", t.name, "\" has dtype ", StDtypeName(t.dtype),
          ", expected F32, BF16, F16", allow_fp8 ? " or F8_E4M3" : "",
          t.dtype == StDtype::kU8 && !nvfp4_
              ? " (U8 weights are read as NVFP4 only when hf_quant_config.json or config.json's "
                "quantization_config says quant_algo NVFP4)"
              : ""));
    }
    return absl::OkStatus();
  }

  // An NVFP4 matrix [rows, cols]: `name` U8 [rows, cols / 2], its `name`_scale F8_E4M3
  // [rows, cols / 16] and `name`_scale_2 one F32 (shape [] or [1]). The activation scale
  // (input_scale) is not needed for weight-only use and is not read.
  absl::StatusOr<MatrixSource> Nvfp4Matrix(const StTensor& t, const std::string& name,
                                           int64_t rows, int64_t cols) const {
    if (cols % common::kNvfp4Block != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          *t.file, ": NVFP4 tensor \"", name, "\" has ", cols,
          " input features, not a multiple of the group size ", common::kNvfp4Block));
    }
    const std::vector<int64_t> want = {rows, cols / 2};
    if (t.shape != want) {
      return absl::InvalidArgumentError(absl::StrCat(
          *t.file, ": NVFP4 tensor \"", name, "\" has shape ", ShapeStr(t.shape), ", expected ",
          ShapeStr(want), " (two e2m1 codes per byte)"));
    }
    const std::string sname = name + "_scale", gname = name + "_scale_2";
    const StTensor* sc = ckpt_.Find(sname);
    if (sc == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(ckpt_.description(), ": tensor \"", sname,
                                                     "\" (the e4m3 group scales of NVFP4 \"",
                                                     name, "\") is missing"));
    }
    const std::vector<int64_t> swant = {rows, cols / common::kNvfp4Block};
    if (sc->dtype != StDtype::kF8E4M3 || sc->shape != swant) {
      return absl::InvalidArgumentError(absl::StrCat(
          *sc->file, ": tensor \"", sname, "\" is ", StDtypeName(sc->dtype), " ",
          ShapeStr(sc->shape), ", expected F8_E4M3 ", ShapeStr(swant), " (one scale per ",
          common::kNvfp4Block, " weights)"));
    }
    const StTensor* g = ckpt_.Find(gname);
    if (g == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(ckpt_.description(), ": tensor \"", gname,
                                                     "\" (the per-tensor scale of NVFP4 \"",
                                                     name, "\") is missing"));
    }
    if (g->dtype != StDtype::kF32 || g->numel() != 1) {
      return absl::InvalidArgumentError(
          absl::StrCat(*g->file, ": tensor \"", gname, "\" is ", StDtypeName(g->dtype), " ",
                       ShapeStr(g->shape), ", expected one F32 (the per-tensor scale)"));
    }
    MatrixSource s;
    s.tensor = &t;
    s.data = t.data;
    s.rows = rows;
    s.cols = cols;
    s.dtype = StDtype::kU8;
    s.block_scales = sc->data;
    std::memcpy(&s.global_scale, g->data, sizeof(float));
    if (!std::isfinite(s.global_scale) || s.global_scale <= 0.0f) {
      return absl::InvalidArgumentError(absl::StrCat(*g->file, ": tensor \"", gname, "\" is ",
                                                     s.global_scale,
                                                     ", expected a positive finite scale"));
    }
    return s;
  }

  absl::Status AttachScales(const std::string& name, MatrixSource* s) const {
    const std::string sname = name + "_scale_inv";
    const StTensor* sc = ckpt_.Find(sname);
    if (sc == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(ckpt_.description(), ": tensor \"", sname,
                                                     "\" (the block scales of F8_E4M3 \"", name,
                                                     "\") is missing"));
    }
    const std::vector<int64_t> want = {CeilDiv(s->rows, kFp8Block), CeilDiv(s->cols, kFp8Block)};
    if (sc->shape != want) {
      return absl::InvalidArgumentError(
          absl::StrCat(*sc->file, ": tensor \"", sname, "\" has shape ", ShapeStr(sc->shape),
                       ", expected ", ShapeStr(want), " (128x128 blocks)"));
    }
    if (sc->dtype != StDtype::kF32 && sc->dtype != StDtype::kBf16 && sc->dtype != StDtype::kF16) {
      return absl::InvalidArgumentError(absl::StrCat(*sc->file, ": tensor \"", sname,
                                                     "\" has dtype ", StDtypeName(sc->dtype),
                                                     ", expected F32, BF16 or F16"));
    }
    s->scale_inv = sc;
    return absl::OkStatus();
  }

  const Checkpoint& ckpt_;
  bool nvfp4_;
};

// One dense tensor to fill.
struct DenseJob {
  MatrixSource src;
  Tensor* dst;
};

// One routed expert to convert: gate [I, H], up [I, H], down [H, I].
struct ExpertJob {
  int moe_layer, expert;
  MatrixSource gate, up, down;
};

absl::Status AllocateTensor(DType dtype, int64_t rows, int64_t cols, Tensor* t) {
  t->dtype = dtype;
  t->rows = rows;
  t->cols = cols;
  const size_t esize = dtype == DType::kF32 ? 4 : 2;
  ASSIGN_OR_RETURN(t->data, common::AlignedBuffer<uint8_t>::Allocate(rows * cols * esize));
  return absl::OkStatus();
}

void RunDense(const DenseJob& job, float* row_scratch) {
  const MatrixSource& s = job.src;
  if (job.dst->dtype == DType::kBf16) {
    s.ToBf16(job.dst->mutable_bf16(), row_scratch);
  } else {
    s.ToFloat(job.dst->mutable_f32());
  }
}

// Bytes of one row of `cols` weights in a packed 4-bit format (scales included).
int64_t FourBitRowBytes(WeightFormat f, int64_t cols) {
  switch (f) {
    case WeightFormat::kQ4_0:
      return cols / common::kQ4_0Block * static_cast<int64_t>(sizeof(common::BlockQ4_0));
    case WeightFormat::kMxfp4:
      return cols / 2 + cols / common::kMxfp4Block;
    case WeightFormat::kNvfp4:
      return cols / 2 + cols / common::kNvfp4Block;
    default:
      return 0;
  }
}

// Bank indices in the store, per format (see ModelWeights::experts).
struct Banks {
  int gate_up = -1, down = -1, gate_up_scales = -1, down_scales = -1;
  int gate_up_global = -1, up_global = -1, down_global = -1;
};

absl::StatusOr<moe_cache::BankLayout> MakeLayout(WeightFormat f, int64_t H, int64_t I, Banks* banks,
                                                 bool* padded_scales) {
  std::vector<moe_cache::BankSpec> specs;
  auto add = [&](const char* name, int64_t bytes) {
    specs.push_back({name, static_cast<uint64_t>(bytes), 0});
    return static_cast<int>(specs.size()) - 1;
  };
  switch (f) {
    case WeightFormat::kBf16:
      banks->gate_up = add("gate_up", 2 * I * H * 2);
      banks->down = add("down", H * I * 2);
      break;
    case WeightFormat::kFp8Block:
      banks->gate_up = add("gate_up", 2 * I * H);
      banks->gate_up_scales =
          add("gate_up_scales", CeilDiv(2 * I, kFp8Block) * CeilDiv(H, kFp8Block) * 4);
      banks->down = add("down", H * I);
      banks->down_scales = add("down_scales", CeilDiv(H, kFp8Block) * CeilDiv(I, kFp8Block) * 4);
      break;
    case WeightFormat::kQ4_0:
    case WeightFormat::kMxfp4:
    case WeightFormat::kNvfp4:
      banks->gate_up = add("gate_up", 2 * I * FourBitRowBytes(f, H));
      banks->down = add("down", H * FourBitRowBytes(f, I));
      if (f == WeightFormat::kNvfp4) {
        // gate_up_global_scale serves the gate rows, up_global_scale the up rows (equal unless
        // the checkpoint quantized gate_proj and up_proj with different per-tensor scales).
        banks->gate_up_global = add("gate_up_global_scale", 4);
        banks->up_global = add("up_global_scale", 4);
        banks->down_global = add("down_global_scale", 4);
      }
      break;
  }
  ASSIGN_OR_RETURN(moe_cache::BankLayout layout, moe_cache::BankLayout::Create(std::move(specs)));
  // One MoE layer's experts must form a contiguous cpu_moe bank: the weight banks' row pitch
  // must equal their payload. It does whenever H and I are multiples of 32 (checked before), so
  // this is an internal error.
  for (int b : {banks->gate_up, banks->down}) {
    if (layout.bank(b).pitch != layout.bank(b).bytes) {
      return absl::InternalError(absl::StrCat(
          "expert format ", std::string(common::WeightFormatName(f)), " with hidden ", H,
          " and moe_intermediate_size ", I, ": bank '", layout.bank(b).name, "' takes ",
          layout.bank(b).bytes, " bytes per expert, not a multiple of ", moe_cache::kRowAlignment,
          ", so a layer's experts cannot form one contiguous bank"));
    }
  }
  // fp8 scale rows of small shapes are padded in the store; cpu_moe then reads copies.
  *padded_scales = false;
  for (int b : {banks->gate_up_scales, banks->down_scales}) {
    if (b >= 0 && layout.bank(b).pitch != layout.bank(b).bytes) *padded_scales = true;
  }
  return layout;
}

// Per-worker scratch for expert conversion (sized for one expert, reused across experts): the
// only intermediate copies a load makes, one expert at a time per worker.
struct Scratch {
  std::vector<float> gate_up, down;  // [2I, H], [H, I] floats
  std::vector<uint8_t> gu_bytes, down_bytes;
  std::vector<uint8_t> gu_codes, gu_scales, down_codes, down_scales;
};

// Converts one expert into the store's banks in the chosen format. Borrows the store and the
// ModelWeights (for nvfp4 global scales and padded fp8 scales); Run() may run concurrently for
// distinct experts, each with its own Scratch.
class ExpertConverter {
 public:
  ExpertConverter(WeightFormat f, int64_t H, int64_t I, const Banks& banks,
                  moe_cache::ExpertStore* store, ModelWeights* weights)
      : f_(f), H_(H), I_(I), banks_(banks), store_(store), weights_(weights) {}

  absl::Status Run(const ExpertJob& job, Scratch& s) const {
    switch (f_) {
      case WeightFormat::kBf16:
        return RunBf16(job, s);
      case WeightFormat::kFp8Block:
        return RunFp8(job, s);
      default:
        return RunFourBit(job, s);
    }
  }

 private:
  absl::Status Write(const ExpertJob& job, int bank, const void* p, size_t n) const {
    return store_->WriteBank(job.moe_layer, job.expert, bank,
                             absl::MakeConstSpan(static_cast<const uint8_t*>(p), n));
  }

  void GateUpToFloat(const ExpertJob& job, Scratch& s) const {
    s.gate_up.resize(2 * I_ * H_);
    s.down.resize(H_ * I_);
    job.gate.ToFloat(s.gate_up.data());
    job.up.ToFloat(s.gate_up.data() + I_ * H_);
    job.down.ToFloat(s.down.data());
  }

  absl::Status RunBf16(const ExpertJob& job, Scratch& s) const {
    s.gu_bytes.resize(2 * I_ * H_ * 2);
    s.down_bytes.resize(H_ * I_ * 2);
    s.gate_up.resize(std::max(H_, I_));
    uint16_t* gu = reinterpret_cast<uint16_t*>(s.gu_bytes.data());
    job.gate.ToBf16(gu, s.gate_up.data());
    job.up.ToBf16(gu + I_ * H_, s.gate_up.data());
    job.down.ToBf16(reinterpret_cast<uint16_t*>(s.down_bytes.data()), s.gate_up.data());
    RETURN_IF_ERROR(Write(job, banks_.gate_up, s.gu_bytes.data(), s.gu_bytes.size()));
    return Write(job, banks_.down, s.down_bytes.data(), s.down_bytes.size());
  }

  // FP8 sources whose blocks line up with the stacked [gate; up] go in as they are: the bytes
  // and scales of a 128x128-block checkpoint are exactly fp8_block's.
  bool Fp8Passthrough(const ExpertJob& job) const {
    return job.gate.is_fp8() && job.up.is_fp8() && job.down.is_fp8() && I_ % kFp8Block == 0 &&
           H_ % kFp8Block == 0;
  }

  static void ScalesToFloat(const StTensor& sc, float* out) {
    const int ssize = StDtypeSize(sc.dtype);
    for (int64_t i = 0; i < sc.numel(); ++i) out[i] = ScalarToFloat(sc.dtype, sc.data + i * ssize);
  }

  absl::Status RunFp8(const ExpertJob& job, Scratch& s) const {
    const int64_t gu_sc = CeilDiv(2 * I_, kFp8Block) * CeilDiv(H_, kFp8Block);
    const int64_t dn_sc = CeilDiv(H_, kFp8Block) * CeilDiv(I_, kFp8Block);
    s.gu_bytes.resize(2 * I_ * H_);
    s.down_bytes.resize(H_ * I_);
    s.gu_scales.resize(gu_sc * 4);
    s.down_scales.resize(dn_sc * 4);
    float* gu_scales = reinterpret_cast<float*>(s.gu_scales.data());
    float* dn_scales = reinterpret_cast<float*>(s.down_scales.data());
    if (Fp8Passthrough(job)) {
      std::memcpy(s.gu_bytes.data(), job.gate.data, I_ * H_);
      std::memcpy(s.gu_bytes.data() + I_ * H_, job.up.data, I_ * H_);
      std::memcpy(s.down_bytes.data(), job.down.data, H_ * I_);
      ScalesToFloat(*job.gate.scale_inv, gu_scales);
      ScalesToFloat(*job.up.scale_inv, gu_scales + gu_sc / 2);
      ScalesToFloat(*job.down.scale_inv, dn_scales);
    } else {
      GateUpToFloat(job, s);
      common::QuantizeFp8Block(s.gate_up.data(), 2 * I_, H_, s.gu_bytes.data(), gu_scales);
      common::QuantizeFp8Block(s.down.data(), H_, I_, s.down_bytes.data(), dn_scales);
    }
    if (!weights_->gate_up_scales.empty()) {
      // Distinct (layer, expert) ranges: no two jobs write the same elements.
      std::memcpy(weights_->gate_up_scales[job.moe_layer].data() + job.expert * gu_sc, gu_scales,
                  gu_sc * sizeof(float));
      std::memcpy(weights_->down_scales[job.moe_layer].data() + job.expert * dn_sc, dn_scales,
                  dn_sc * sizeof(float));
    }
    RETURN_IF_ERROR(Write(job, banks_.gate_up, s.gu_bytes.data(), s.gu_bytes.size()));
    RETURN_IF_ERROR(Write(job, banks_.gate_up_scales, s.gu_scales.data(), s.gu_scales.size()));
    RETURN_IF_ERROR(Write(job, banks_.down, s.down_bytes.data(), s.down_bytes.size()));
    return Write(job, banks_.down_scales, s.down_scales.data(), s.down_scales.size());
  }

  // Quantizes [rows, cols] floats row by row into cpu_moe's row-major layout of the format.
  void QuantizeRows(const float* x, int64_t rows, int64_t cols, float global_scale,
                    std::vector<uint8_t>& codes, std::vector<uint8_t>& scales) const {
    switch (f_) {
      case WeightFormat::kQ4_0: {
        const int64_t row_bytes = FourBitRowBytes(f_, cols);
        codes.resize(rows * row_bytes);
        for (int64_t r = 0; r < rows; ++r) {
          common::QuantizeRowQ4_0(
              x + r * cols, cols,
              reinterpret_cast<common::BlockQ4_0*>(codes.data() + r * row_bytes));
        }
        scales.clear();
        return;
      }
      case WeightFormat::kMxfp4:
        codes.resize(rows * cols / 2);
        scales.resize(rows * cols / common::kMxfp4Block);
        for (int64_t r = 0; r < rows; ++r) {
          common::QuantizeRowMxfp4(x + r * cols, cols, codes.data() + r * cols / 2,
                                   scales.data() + r * cols / common::kMxfp4Block);
        }
        return;
      case WeightFormat::kNvfp4:
        codes.resize(rows * cols / 2);
        scales.resize(rows * cols / common::kNvfp4Block);
        for (int64_t r = 0; r < rows; ++r) {
          common::QuantizeRowNvfp4(x + r * cols, cols, global_scale, codes.data() + r * cols / 2,
                                   scales.data() + r * cols / common::kNvfp4Block);
        }
        return;
      default:
        return;
    }
  }

  // NVFP4 sources into nvfp4 banks: the codes and e4m3 scales as they are (the checkpoint's
  // row-major layout and nibble order are cpu_moe's), gate and up each with its own global scale.
  bool Nvfp4Passthrough(const ExpertJob& job) const {
    return f_ == WeightFormat::kNvfp4 && job.gate.is_nvfp4() && job.up.is_nvfp4() &&
           job.down.is_nvfp4();
  }

  static void CopyNvfp4(const MatrixSource& m, uint8_t* codes, uint8_t* scales) {
    std::memcpy(codes, m.data, m.rows * m.cols / 2);
    std::memcpy(scales, m.block_scales, m.rows * m.cols / common::kNvfp4Block);
  }

  absl::Status RunFourBit(const ExpertJob& job, Scratch& s) const {
    float gu_global = 1.0f, up_global = 1.0f, dn_global = 1.0f;
    if (Nvfp4Passthrough(job)) {
      const int64_t half_codes = I_ * H_ / 2, half_scales = I_ * H_ / common::kNvfp4Block;
      s.gu_codes.resize(2 * half_codes);
      s.gu_scales.resize(2 * half_scales);
      s.down_codes.resize(H_ * I_ / 2);
      s.down_scales.resize(H_ * I_ / common::kNvfp4Block);
      CopyNvfp4(job.gate, s.gu_codes.data(), s.gu_scales.data());
      CopyNvfp4(job.up, s.gu_codes.data() + half_codes, s.gu_scales.data() + half_scales);
      CopyNvfp4(job.down, s.down_codes.data(), s.down_scales.data());
      gu_global = job.gate.global_scale;
      up_global = job.up.global_scale;
      dn_global = job.down.global_scale;
    } else {
      GateUpToFloat(job, s);
      if (f_ == WeightFormat::kNvfp4) {
        gu_global = up_global = common::Nvfp4GlobalScale(s.gate_up.data(), 2 * I_ * H_);
        dn_global = common::Nvfp4GlobalScale(s.down.data(), H_ * I_);
      }
      QuantizeRows(s.gate_up.data(), 2 * I_, H_, gu_global, s.gu_codes, s.gu_scales);
      QuantizeRows(s.down.data(), H_, I_, dn_global, s.down_codes, s.down_scales);
    }
    // A one-expert row-major bank, packed into panels (the layout cpu_moe reads fastest).
    cpu_moe::ExpertBank one;
    one.format = f_;
    one.num_experts = 1;
    one.hidden = static_cast<int>(H_);
    one.intermediate = static_cast<int>(I_);
    one.gate_up_weights = s.gu_codes.data();
    one.down_weights = s.down_codes.data();
    one.gate_up_scales = s.gu_scales.empty() ? nullptr : s.gu_scales.data();
    one.down_scales = s.down_scales.empty() ? nullptr : s.down_scales.data();
    one.gate_up_global_scales = &gu_global;
    one.up_global_scales = &up_global;
    one.down_global_scales = &dn_global;
    ASSIGN_OR_RETURN(std::unique_ptr<cpu_moe::PanelBank> panels, cpu_moe::PackPanels(one));
    RETURN_IF_ERROR(Write(job, banks_.gate_up, panels->gate_up.data(), panels->gate_up.bytes()));
    RETURN_IF_ERROR(Write(job, banks_.down, panels->down.data(), panels->down.bytes()));
    if (f_ == WeightFormat::kNvfp4) {
      RETURN_IF_ERROR(Write(job, banks_.gate_up_global, &gu_global, sizeof(float)));
      RETURN_IF_ERROR(Write(job, banks_.up_global, &up_global, sizeof(float)));
      RETURN_IF_ERROR(Write(job, banks_.down_global, &dn_global, sizeof(float)));
    }
    return absl::OkStatus();
  }

  WeightFormat f_;
  int64_t H_, I_;
  Banks banks_;
  moe_cache::ExpertStore* store_;
  ModelWeights* weights_;
};

// Prints "loading DIR: 1.2/3.4 GiB, 456 MiB/s, about 5 s" on stderr about once a second, from
// a thread it owns, once the load has run for a second, and a last line when it ends. Add() and
// SetTotal() are thread-safe.
class Progress {
 public:
  Progress(bool enabled, std::string what) : what_(std::move(what)), start_(Clock::now()) {
    if (enabled) thread_ = std::thread([this] { Loop(); });
  }
  ~Progress() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      done_flag_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
    if (printed_) Print(/*final=*/true);
  }
  void Add(uint64_t bytes) { done_.fetch_add(bytes, std::memory_order_relaxed); }
  // The bytes the whole load will convert (known once every tensor has been checked).
  void SetTotal(uint64_t total) { total_.store(total, std::memory_order_relaxed); }

 private:
  using Clock = std::chrono::steady_clock;
  void Loop() {
    std::unique_lock<std::mutex> lock(mu_);
    while (!cv_.wait_for(lock, std::chrono::seconds(1), [this] { return done_flag_; })) {
      Print(/*final=*/false);
      printed_ = true;
    }
  }
  void Print(bool final) {
    const double secs = std::chrono::duration<double>(Clock::now() - start_).count();
    const double done = static_cast<double>(done_.load(std::memory_order_relaxed));
    const double total = static_cast<double>(total_.load(std::memory_order_relaxed));
    if (total == 0) {
      std::fprintf(stderr, "loading %s: checking tensors, allocating the expert store (%.0f s)\n",
                   what_.c_str(), secs);
      return;
    }
    const double rate = secs > 0 ? done / secs : 0;
    const double left = rate > 0 ? (total - done) / rate : 0;
    std::fprintf(stderr, "loading %s: %.2f/%.2f GiB, %.0f MiB/s, %s %.0f s\n", what_.c_str(),
                 done / (1 << 30), total / (1 << 30), rate / (1 << 20),
                 !final          ? "about"
                 : done == total ? "done in"
                                 : "stopped after",
                 final ? secs : left);
  }

  std::string what_;
  std::atomic<uint64_t> total_{0};
  Clock::time_point start_;
  std::atomic<uint64_t> done_{0};
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_flag_ = false;
  bool printed_ = false;
  std::thread thread_;
};

uint64_t SourceBytes(const MatrixSource& s) {
  const uint64_t n = static_cast<uint64_t>(s.rows) * s.cols;
  return s.is_nvfp4() ? n / 2 + n / common::kNvfp4Block : n * StDtypeSize(s.dtype);
}

// ModelOpt's quantization config: hf_quant_config.json ({"quantization": {"quant_algo",
// "group_size", "exclude_modules"}}) or config.json's "quantization_config" with quant_method
// "modelopt" ({"quant_algo", "group_size", "ignore"}). True for NVFP4 (group size 16, the only
// one the format defines); false for a checkpoint without a ModelOpt config. Other ModelOpt
// algorithms are InvalidArgument. Which modules are quantized is read from the tensors
// themselves (a quantized one is U8 with its scales), so the exclude lists are not needed.
absl::StatusOr<bool> ReadQuantization(const std::string& dir) {
  using Json = nlohmann::json;
  auto read = [](const std::string& path, Json* out) -> absl::StatusOr<bool> {
    std::ifstream in(path);
    if (!in) return false;
    *out = Json::parse(in, nullptr, /*allow_exceptions=*/false);
    if (out->is_discarded()) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": not valid JSON"));
    }
    return true;
  };
  Json q;
  std::string where;
  Json hq;
  ASSIGN_OR_RETURN(const bool has_hq, read(dir + "/hf_quant_config.json", &hq));
  if (has_hq && hq.is_object() && hq.contains("quantization") && hq["quantization"].is_object()) {
    q = hq["quantization"];
    where = dir + "/hf_quant_config.json";
  } else {
    Json cfg;
    ASSIGN_OR_RETURN(const bool has_cfg, read(dir + "/config.json", &cfg));
    if (!has_cfg || !cfg.is_object() || !cfg.contains("quantization_config")) return false;
    const Json& qc = cfg["quantization_config"];
    if (!qc.is_object() || !qc.contains("quant_method") || !qc["quant_method"].is_string() ||
        qc["quant_method"].get<std::string>().rfind("modelopt", 0) != 0) {
      return false;  // another method (FP8 blocks are recognised by their tensors)
    }
    q = qc;
    where = dir + "/config.json quantization_config";
  }
  if (!q.contains("quant_algo") || !q["quant_algo"].is_string()) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": no quant_algo string"));
  }
  std::string algo = q["quant_algo"].get<std::string>();
  for (char& ch : algo) ch = static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
  if (algo != "NVFP4") {
    return absl::InvalidArgumentError(absl::StrCat(where, ": quant_algo \"", algo,
                                                   "\" is not supported (NVFP4 is)"));
  }
  if (q.contains("group_size") &&
      (!q["group_size"].is_number_integer() || q["group_size"].get<int64_t>() != 16)) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": NVFP4 group_size ",
                                                   q["group_size"].dump(), ", expected 16"));
  }
  return true;
}

}  // namespace

WeightFormat CheckpointExpertFormat(const ExpertFormatCounts& counts) {
  // Narrowest first, so that a tie goes to it.
  if (counts.nvfp4 > 0 && counts.nvfp4 >= counts.fp8 && counts.nvfp4 >= counts.other) {
    return WeightFormat::kNvfp4;
  }
  if (counts.fp8 > 0 && counts.fp8 >= counts.other) return WeightFormat::kFp8Block;
  return WeightFormat::kBf16;
}

absl::StatusOr<std::optional<WeightFormat>> ParseExpertFormat(std::string_view name) {
  if (name == kAutoExpertFormat) return std::nullopt;
  absl::StatusOr<WeightFormat> f = common::ParseWeightFormat(name);
  if (!f.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "expert format \"", absl::string_view(name.data(), name.size()),
        "\": must be auto (the checkpoint's own) or one of bf16, fp8_block, q4_0, nvfp4, mxfp4"));
  }
  return *f;
}

absl::StatusOr<moe_cache::BankLayout> ExpertBankLayout(WeightFormat format, int64_t hidden,
                                                       int64_t moe_intermediate) {
  Banks banks;
  bool padded_scales = false;
  return MakeLayout(format, hidden, moe_intermediate, &banks, &padded_scales);
}

absl::StatusOr<std::unique_ptr<ModelWeights>> LoadModel(const std::string& dir,
                                                        const LoadOptions& options) {
  // The clock runs from the start: checking the files and allocating the store count too.
  Progress progress(options.progress, dir);
  auto w = std::make_unique<ModelWeights>();
  ASSIGN_OR_RETURN(w->config, ModelConfig::FromFile(dir + "/config.json"));
  const ModelConfig& c = w->config;
  ASSIGN_OR_RETURN(std::unique_ptr<Checkpoint> ckpt, Checkpoint::Open(dir));
  ASSIGN_OR_RETURN(const bool nvfp4, ReadQuantization(dir));
  TensorFinder find(*ckpt, nvfp4);
  const DType dd = options.dense_dtype;
  const int64_t H = c.hidden_size, V = c.vocab_size, hd = c.head_dim;
  const int64_t q_out = static_cast<int64_t>(c.num_attention_heads) * hd;
  const int64_t kv_out = static_cast<int64_t>(c.num_key_value_heads) * hd;

  // Pass 1, sequential: resolve and check every tensor, allocate the destinations. Nothing is
  // converted until the whole checkpoint is known to be complete and consistent.
  std::vector<DenseJob> dense;
  auto add_dense = [&](const std::string& name, int64_t rows, int64_t cols, bool vector,
                       DType dtype, Tensor* dst) -> absl::Status {
    ASSIGN_OR_RETURN(MatrixSource src, find.Matrix(name, rows, cols, vector));
    RETURN_IF_ERROR(AllocateTensor(dtype, vector ? 1 : rows, cols, dst));
    dense.push_back({src, dst});
    return absl::OkStatus();
  };
  // The text model's tensors: "model." (a causal LM's own checkpoint) or
  // "model.language_model." (a multimodal wrapper's, whose vision tower and multi-token
  // prediction head are not served).
  const std::string root =
      find.Has("model.language_model.embed_tokens.weight") ? "model.language_model." : "model.";
  if (root != "model." || c.multimodal) {
    int vision = 0, mtp = 0;
    for (const auto& file : ckpt->files()) {
      for (const StTensor& t : file->tensors()) {
        vision += t.name.rfind("model.visual.", 0) == 0 ? 1 : 0;
        mtp += t.name.rfind("mtp.", 0) == 0 ? 1 : 0;
      }
    }
    std::fprintf(stderr,
                 "%s: the text model of a multimodal checkpoint (tensors under %s); ignoring "
                 "its vision tower (%d tensors) and multi-token-prediction head (%d tensors)\n",
                 dir.c_str(), root.c_str(), vision, mtp);
  }
  RETURN_IF_ERROR(add_dense(root + "embed_tokens.weight", V, H, false, dd, &w->embed_tokens));
  RETURN_IF_ERROR(add_dense(root + "norm.weight", 1, H, true, DType::kF32, &w->final_norm));
  if (!c.tie_word_embeddings) {
    RETURN_IF_ERROR(add_dense("lm_head.weight", V, H, false, dd, &w->lm_head));
  }

  const int num_moe = c.NumMoeLayers();
  const int64_t E = c.num_experts, I = c.moe_intermediate_size;
  std::vector<ExpertJob> experts;
  w->layers.resize(c.num_hidden_layers);
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    LayerWeights& L = w->layers[l];
    const std::string p = absl::StrCat(root, "layers.", l, ".");
    RETURN_IF_ERROR(
        add_dense(p + "input_layernorm.weight", 1, H, true, DType::kF32, &L.input_layernorm));
    RETURN_IF_ERROR(add_dense(p + "post_attention_layernorm.weight", 1, H, true, DType::kF32,
                              &L.post_attention_layernorm));
    if (c.IsLinearAttentionLayer(l)) {
      const LinearAttentionConfig& la = c.linear;
      const int64_t nv = la.num_value_heads, C = la.conv_dim(), Vd = la.value_dim();
      const std::string a = p + "linear_attn.";
      RETURN_IF_ERROR(add_dense(a + "in_proj_qkv.weight", C, H, false, dd, &L.in_proj_qkv));
      RETURN_IF_ERROR(add_dense(a + "in_proj_z.weight", Vd, H, false, dd, &L.in_proj_z));
      RETURN_IF_ERROR(add_dense(a + "in_proj_b.weight", nv, H, false, dd, &L.in_proj_b));
      RETURN_IF_ERROR(add_dense(a + "in_proj_a.weight", nv, H, false, dd, &L.in_proj_a));
      {
        ASSIGN_OR_RETURN(MatrixSource conv, find.Conv(a + "conv1d.weight", C, la.conv_kernel));
        RETURN_IF_ERROR(AllocateTensor(DType::kF32, C, la.conv_kernel, &L.conv1d));
        dense.push_back({conv, &L.conv1d});
      }
      RETURN_IF_ERROR(add_dense(a + "dt_bias", 1, nv, true, DType::kF32, &L.dt_bias));
      RETURN_IF_ERROR(add_dense(a + "A_log", 1, nv, true, DType::kF32, &L.a_log));
      RETURN_IF_ERROR(
          add_dense(a + "norm.weight", 1, la.value_head_dim, true, DType::kF32, &L.linear_norm));
      RETURN_IF_ERROR(add_dense(a + "out_proj.weight", H, Vd, false, dd, &L.out_proj));
    } else {
      const std::string a = p + "self_attn.";
      // With the output gate, q_proj holds each head's query rows then its gate rows.
      const int64_t q_rows = c.attn_output_gate ? 2 * q_out : q_out;
      RETURN_IF_ERROR(add_dense(a + "q_proj.weight", q_rows, H, false, dd, &L.q_proj));
      RETURN_IF_ERROR(add_dense(a + "k_proj.weight", kv_out, H, false, dd, &L.k_proj));
      RETURN_IF_ERROR(add_dense(a + "v_proj.weight", kv_out, H, false, dd, &L.v_proj));
      RETURN_IF_ERROR(add_dense(a + "o_proj.weight", H, q_out, false, dd, &L.o_proj));
      if (c.attention_bias) {
        RETURN_IF_ERROR(add_dense(a + "q_proj.bias", 1, q_out, true, DType::kF32, &L.q_bias));
        RETURN_IF_ERROR(add_dense(a + "k_proj.bias", 1, kv_out, true, DType::kF32, &L.k_bias));
        RETURN_IF_ERROR(add_dense(a + "v_proj.bias", 1, kv_out, true, DType::kF32, &L.v_bias));
      }
      if (c.qk_norm) {
        RETURN_IF_ERROR(add_dense(a + "q_norm.weight", 1, hd, true, DType::kF32, &L.q_norm));
        RETURN_IF_ERROR(add_dense(a + "k_norm.weight", 1, hd, true, DType::kF32, &L.k_norm));
      }
    }
    const std::string m = p + "mlp.";
    L.is_moe = c.IsMoeLayer(l);
    L.moe_index = c.MoeLayerIndex(l);
    if (!L.is_moe) {
      const int64_t D = c.intermediate_size;
      RETURN_IF_ERROR(add_dense(m + "gate_proj.weight", D, H, false, dd, &L.mlp_gate_proj));
      RETURN_IF_ERROR(add_dense(m + "up_proj.weight", D, H, false, dd, &L.mlp_up_proj));
      RETURN_IF_ERROR(add_dense(m + "down_proj.weight", H, D, false, dd, &L.mlp_down_proj));
      continue;
    }
    RETURN_IF_ERROR(add_dense(m + "gate.weight", E, H, false, dd, &L.router));
    if (c.shared_expert_intermediate_size > 0) {
      const int64_t S = c.shared_expert_intermediate_size;
      const std::string se = m + "shared_expert.";
      RETURN_IF_ERROR(add_dense(se + "gate_proj.weight", S, H, false, dd, &L.shared_gate_proj));
      RETURN_IF_ERROR(add_dense(se + "up_proj.weight", S, H, false, dd, &L.shared_up_proj));
      RETURN_IF_ERROR(add_dense(se + "down_proj.weight", H, S, false, dd, &L.shared_down_proj));
      RETURN_IF_ERROR(
          add_dense(m + "shared_expert_gate.weight", 1, H, false, dd, &L.shared_expert_gate));
    }
    const std::string fused_gu = m + "experts.gate_up_proj";
    if (find.Has(fused_gu)) {
      // transformers 5's fused layout: gate_up_proj [E, 2I, H] is, per expert, gate_proj's rows
      // then up_proj's (MergeModulelist(dim=0) then Concatenate(dim=1) in its conversion
      // mapping); down_proj [E, H, I].
      ASSIGN_OR_RETURN(const StTensor* gu, find.Fused(fused_gu, {E, 2 * I, H}));
      ASSIGN_OR_RETURN(const StTensor* dn, find.Fused(m + "experts.down_proj", {E, H, I}));
      const int gs = StDtypeSize(gu->dtype), ds = StDtypeSize(dn->dtype);
      for (int64_t e = 0; e < E; ++e) {
        ExpertJob job{L.moe_index, static_cast<int>(e), {}, {}, {}};
        const uint8_t* base = gu->data + e * 2 * I * H * gs;
        job.gate = {gu, base, I, H, gu->dtype, nullptr};
        job.up = {gu, base + I * H * gs, I, H, gu->dtype, nullptr};
        job.down = {dn, dn->data + e * H * I * ds, H, I, dn->dtype, nullptr};
        experts.push_back(job);
      }
    } else {
      for (int64_t e = 0; e < E; ++e) {
        const std::string x = absl::StrCat(m, "experts.", e, ".");
        ExpertJob job{L.moe_index, static_cast<int>(e), {}, {}, {}};
        ASSIGN_OR_RETURN(job.gate, find.Matrix(x + "gate_proj.weight", I, H, false));
        ASSIGN_OR_RETURN(job.up, find.Matrix(x + "up_proj.weight", I, H, false));
        ASSIGN_OR_RETURN(job.down, find.Matrix(x + "down_proj.weight", H, I, false));
        experts.push_back(job);
      }
    }
  }

  ExpertFormatCounts counts;
  for (const ExpertJob& j : experts) {
    (j.gate.is_nvfp4() ? counts.nvfp4 : j.gate.is_fp8() ? counts.fp8 : counts.other) += 1;
  }
  const WeightFormat ef = options.expert_format.value_or(CheckpointExpertFormat(counts));
  w->expert_format = ef;
  if (!options.expert_format.has_value() && !experts.empty()) {
    std::fprintf(stderr,
                 "%s: expert format auto: %s, the checkpoint's own (routed experts: %lld NVFP4, "
                 "%lld FP8, %lld BF16/F16/F32)\n",
                 dir.c_str(), std::string(common::WeightFormatName(ef)).c_str(),
                 static_cast<long long>(counts.nvfp4), static_cast<long long>(counts.fp8),
                 static_cast<long long>(counts.other));
  }
  Banks banks;
  if (num_moe > 0) {
    if (H % 32 != 0 || I % 32 != 0 || H > 16384 || I > 16384) {
      return absl::InvalidArgumentError(absl::StrCat(
          dir, "/config.json: the CPU expert kernels need hidden_size (", H,
          ") and moe_intermediate_size (", I, ") to be multiples of 32, at most 16384"));
    }
    bool padded_scales = false;
    ASSIGN_OR_RETURN(moe_cache::BankLayout layout, MakeLayout(ef, H, I, &banks, &padded_scales));
    moe_cache::ExpertStore::Options so;
    so.num_layers = num_moe;
    so.num_experts = static_cast<int>(E);
    so.require_pinned = options.require_pinned;
    ASSIGN_OR_RETURN(w->experts, moe_cache::ExpertStore::Create(so, layout));
    if (padded_scales) {
      w->gate_up_scales.assign(
          num_moe, std::vector<float>(E * CeilDiv(2 * I, kFp8Block) * CeilDiv(H, kFp8Block)));
      w->down_scales.assign(num_moe,
                            std::vector<float>(E * CeilDiv(H, kFp8Block) * CeilDiv(I, kFp8Block)));
    }
  }

  // Pass 2, parallel: convert. Large dense tensors first so they do not trail at the end.
  std::sort(dense.begin(), dense.end(), [](const DenseJob& a, const DenseJob& b) {
    return a.src.rows * a.src.cols > b.src.rows * b.src.cols;
  });
  uint64_t total = 0;
  for (const DenseJob& j : dense) total += SourceBytes(j.src);
  for (const ExpertJob& j : experts) {
    total += SourceBytes(j.gate) + SourceBytes(j.up) + SourceBytes(j.down);
  }
  // More threads than this only add start-up cost: the conversion is bound by memory.
  const int threads =
      std::min(256, options.threads > 0 ? options.threads : common::PhysicalCoreCount());
  common::ThreadPool pool(threads);
  std::vector<Scratch> scratch(pool.num_workers());
  std::vector<absl::Status> status(dense.size() + experts.size());
  const ExpertConverter convert(ef, H, I, banks, w->experts.get(), w.get());
  progress.SetTotal(total);
  {
    pool.ParallelFor(status.size(), [&](uint64_t i, int worker) {
      Scratch& s = scratch[worker];
      if (i < dense.size()) {
        s.gate_up.resize(std::max<int64_t>(s.gate_up.size(), dense[i].src.cols));
        RunDense(dense[i], s.gate_up.data());
        progress.Add(SourceBytes(dense[i].src));
        return;
      }
      const ExpertJob& job = experts[i - dense.size()];
      status[i] = convert.Run(job, s);
      progress.Add(SourceBytes(job.gate) + SourceBytes(job.up) + SourceBytes(job.down));
    });
  }
  for (const absl::Status& st : status) RETURN_IF_ERROR(st);
  if (nvfp4) {
    int dense_nvfp4 = 0, experts_nvfp4 = 0;
    for (const DenseJob& j : dense) dense_nvfp4 += j.src.is_nvfp4() ? 1 : 0;
    for (const ExpertJob& j : experts) experts_nvfp4 += j.gate.is_nvfp4() ? 1 : 0;
    std::fprintf(stderr,
                 "%s: NVFP4 checkpoint: %d dense NVFP4 tensors dequantized to %s; %d of %zu "
                 "routed experts NVFP4, %s\n",
                 dir.c_str(), dense_nvfp4, dd == DType::kF32 ? "f32" : "bf16", experts_nvfp4,
                 experts.size(),
                 ef == WeightFormat::kNvfp4
                     ? "kept as they are (codes and scales copied into the expert store)"
                     : absl::StrCat("dequantized and converted to ",
                                    std::string(common::WeightFormatName(ef)),
                                    " as the expert format asks (nvfp4 keeps them unchanged)")
                           .c_str());
  }
  for (LayerWeights& L : w->layers) {
    // The conv weights tap-major ([kernel, channels]), so that a tap runs over contiguous
    // channels.
    if (L.conv1d.empty()) continue;
    const int64_t C = L.conv1d.rows, K = L.conv1d.cols;
    std::vector<float> t(L.conv1d.f32(), L.conv1d.f32() + C * K);
    float* dst = L.conv1d.mutable_f32();
    for (int64_t ch = 0; ch < C; ++ch) {
      for (int64_t j = 0; j < K; ++j) dst[j * C + ch] = t[ch * K + j];
    }
    L.conv1d.rows = K;
    L.conv1d.cols = C;
  }
  if (c.zero_centered_norms) {
    // The checkpoint's weights w are applied as (1 + w): hold the multipliers. transformers adds
    // in float32 as well (1.0 + weight.float()).
    auto add_one = [](Tensor& t) {
      if (t.empty()) return;
      float* x = t.mutable_f32();
      for (int64_t i = 0; i < t.numel(); ++i) x[i] += 1.0f;
    };
    add_one(w->final_norm);
    for (LayerWeights& L : w->layers) {
      add_one(L.input_layernorm);
      add_one(L.post_attention_layernorm);
      add_one(L.q_norm);
      add_one(L.k_norm);
    }
  }
  return w;
}

}  // namespace moe::engine
