// Request builders shared by the handler, server and binary tests.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "service/tensor.h"
#include "turbokv/v1/turbokv.pb.h"

namespace turbokv::testing {

inline v1::Tensor MakeTensor(const std::vector<float>& values, std::vector<int64_t> shape,
                             v1::DType dtype = v1::DTYPE_F32) {
  v1::Tensor tensor;
  FloatsToTensor(values, shape, dtype, &tensor);
  return tensor;
}

inline v1::CreateSessionRequest MakeCreate(int layers, int kv_heads, int q_heads, int head_dim,
                                           v1::Codec key = v1::CODEC_TURBO3, v1::Codec value = v1::CODEC_TURBO3) {
  v1::CreateSessionRequest request;
  v1::ModelShape* shape = request.mutable_config()->mutable_shape();
  shape->set_layers(layers);
  shape->set_kv_heads(kv_heads);
  shape->set_q_heads(q_heads);
  shape->set_head_dim(head_dim);
  request.mutable_config()->set_key_codec(key);
  request.mutable_config()->set_value_codec(value);
  request.mutable_config()->set_rotation_seed(42);
  return request;
}

// keys/values [n][kv_heads][head_dim] for one layer (layer >= 0), or
// [layers][n][kv_heads][head_dim] for all (layer < 0).
inline v1::AppendRequest MakeAppend(const std::string& id, int layer, int64_t start, const std::vector<float>& keys,
                                    const std::vector<float>& values, std::vector<int64_t> shape) {
  v1::AppendRequest request;
  request.set_session_id(id);
  if (layer < 0) {
    request.set_all_layers(true);
  } else {
    request.set_layer(layer);
  }
  request.set_start(start);
  *request.mutable_keys() = MakeTensor(keys, shape);
  *request.mutable_values() = MakeTensor(values, shape);
  return request;
}

inline std::vector<float> TensorFloats(const v1::Tensor& tensor) {
  std::vector<float> values(tensor.data().size() / 4);
  std::memcpy(values.data(), tensor.data().data(), values.size() * 4);
  return values;
}

}  // namespace turbokv::testing
