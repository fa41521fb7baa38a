#include <cstring>

#include "kernels/block_math.h"
#include "kernels/cpu/cpu_codecs.h"

namespace turbokv {
namespace {

class ScalarCodec final : public Codec {
 public:
  ScalarCodec(const CodecSpec& spec, const CodecLayout& layout) : Codec(spec, layout) {}

  void Encode(size_t n, const float* x, uint8_t* codes, EncodeStats* stats) const override {
    const int d = layout_.head_dim;
    for (size_t v = 0; v < n; ++v) {
      const float* in = x + v * d;
      uint8_t* out = codes + v * code_size();
      QuantizationError error;
      for (int b = 0; b < layout_.blocks; ++b) {
        EncodeBlock(b, in + b * layout_.block_values, out + b * layout_.block_bytes,
                    stats ? &error : nullptr);
      }
      if (stats) stats->AddVector(error);
    }
  }

  void Decode(size_t n, const uint8_t* codes, float* x) const override {
    const int d = layout_.head_dim;
    for (size_t v = 0; v < n; ++v) {
      const uint8_t* in = codes + v * code_size();
      float* out = x + v * d;
      for (int b = 0; b < layout_.blocks; ++b) {
        DecodeBlock(b, in + b * layout_.block_bytes, out + b * layout_.block_values);
      }
    }
  }

  std::string implementation() const override { return "scalar"; }

 private:
  // `error`, when not null, gains what the block lost.
  void EncodeBlock(int block, const float* x, uint8_t* out, QuantizationError* error) const {
    switch (layout_.kind) {
      case CodecKind::kF16:
        for (int i = 0; i < layout_.block_values; ++i) {
          const uint16_t h = FloatToHalfBits(x[i]);
          StoreHalfBits(out + 2 * i, h);
          if (error) {
            error->AddValue(x[i], HalfBitsToFloat(h));
            error->CountField(x[i], h);
          }
        }
        return;
      case CodecKind::kQ8_0:
        EncodeQ8Block(x, out, error);
        return;
      case CodecKind::kQ4_0:
        EncodeQ4Block(x, out, error);
        return;
      default: {
        const int bv = layout_.block_values;
        float z[128];
        uint8_t indices[128];
        std::memcpy(z, x, bv * sizeof(float));
        rotation_->Forward(block, z);
        EncodeTurboRotatedBlock(z, bv, codebook_->bits, codebook_->centroids,
                                codebook_->boundaries, indices, out, error);
        return;
      }
    }
  }

  void DecodeBlock(int block, const uint8_t* in, float* x) const {
    DecodeBlockToKernelDomain(layout_, in, codebook_ ? codebook_->centroids : nullptr, x);
    if (rotation_) rotation_->Inverse(block, x);
  }
};

}  // namespace

std::unique_ptr<Codec> NewScalarCodec(const CodecSpec& spec, const CodecLayout& layout) {
  return std::make_unique<ScalarCodec>(spec, layout);
}

}  // namespace turbokv
