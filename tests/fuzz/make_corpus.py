"""Writes the seed corpus of handler_fuzz (tests/fuzz/corpus/): one valid
request of each kind, for the sessions "0".."3" the harness keeps alive.
Run with the generated stubs on PYTHONPATH:
  PYTHONPATH=build/client/python/package /usr/bin/python3 tests/fuzz/make_corpus.py"""

import os

import numpy as np

from turbokv.v1 import turbokv_pb2 as pb

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus")


def tensor(shape, dtype=pb.DTYPE_F32, seed=0):
    values = np.random.default_rng(seed).standard_normal(shape).astype(np.float16 if dtype == pb.DTYPE_F16 else np.float32)
    return pb.Tensor(dtype=dtype, shape=list(shape), data=values.tobytes())


def write(name, kind, message):
    with open(os.path.join(OUT, name), "wb") as f:
        f.write(bytes([kind]) + message.SerializeToString())


def main():
    os.makedirs(OUT, exist_ok=True)
    shape = pb.ModelShape(layers=2, kv_heads=2, q_heads=4, head_dim=64)
    write("create", 0, pb.CreateSessionRequest(config=pb.SessionConfig(shape=shape, key_codec=pb.CODEC_TURBO2)))
    # Session "0" has 1 kv head, "1" has 2; both 2 layers, head_dim 64.
    write("append_layer", 1, pb.AppendRequest(session_id="0", layer=0, start=0, keys=tensor((20, 1, 64)),
                                              values=tensor((20, 1, 64), seed=1)))
    write("append_all_f16", 1, pb.AppendRequest(session_id="1", all_layers=True, start=0,
                                                keys=tensor((2, 5, 2, 64), pb.DTYPE_F16),
                                                values=tensor((2, 5, 2, 64), pb.DTYPE_F16, 1)))
    write("attend", 2, pb.AttendRequest(session_id="0", layer=0, queries=tensor((2, 2, 64)), positions=[3, 19],
                                        options=pb.AttentionOptions(top_k=3, softcap=30, window=8)))
    write("step", 3, pb.StepRequest(session_id="0", layer=0, position=20, key=tensor((1, 1, 64)),
                                    value=tensor((1, 1, 64)), query=tensor((1, 2, 64))))
    write("read", 4, pb.ReadKvRequest(session_id="0", layers=[0], start=2, end=10, dtype=pb.DTYPE_BF16,
                                      max_tokens_per_message=3))
    write("fork", 5, pb.ForkSessionRequest(source_session_id="0", prefix_tokens=10))
    write("truncate", 6, pb.TruncateSessionRequest(session_id="0", tokens=5))
    write("delete", 7, pb.DeleteSessionRequest(session_id="2"))
    write("get", 8, pb.GetSessionRequest(session_id="3"))
    write("list", 9, pb.ListSessionsRequest())
    write("stats", 10, pb.StatsRequest())
    # Sessions "0" and "2" both have 1 kv head and 2 q heads: one batch.
    write("decode", 11, pb.DecodeRequest(layer=0, session_ids=["0", "2"], positions=[0, 0],
                                         queries=tensor((2, 2, 64)), keys=tensor((2, 1, 64), seed=2),
                                         values=tensor((2, 1, 64), seed=3),
                                         options=pb.AttentionOptions(window=4)))
    write("expire", 12, pb.StatsRequest())


if __name__ == "__main__":
    main()
