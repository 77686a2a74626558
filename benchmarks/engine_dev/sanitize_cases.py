"""A few small launches for compute-sanitizer (memcheck / synccheck) runs:
compute-sanitizer --tool memcheck python3 sanitize_cases.py <build_dir>"""

import sys

import torch

from common import launch, load_module

mk = load_module(sys.argv[1])
cfgs = list(range(mk.gemm_num_configs))
for exp in (103,):  # the cluster experiment, when built in
    try:
        mk.gemm_config_info(exp)
        cfgs.append(exp)
    except ValueError:
        pass
for cfg in cfgs:
    for kind, dt in (
        (0, torch.bfloat16),
        (1, torch.float32),
        (2, torch.float32),
        (3, torch.float32),
    ):
        for M, N, K, grid in ((129, 264, 72, 0), (300, 520, 136, 2)):
            A = torch.randn(M, K, device="cuda").to(torch.bfloat16)
            B = torch.randn(K, N, device="cuda").to(torch.bfloat16)
            C = torch.zeros(M, N, device="cuda", dtype=dt)
            launch(mk, A, B, C, M, N, K, config=cfg, kind=kind, num_sms=grid)
            torch.cuda.synchronize()
            ref = A.float() @ B.float()
            rel = ((C.float() - ref).norm() / ref.norm()).item()
            assert rel < 1e-2, (cfg, kind, M, N, K, rel)
print("sanitize cases done")
