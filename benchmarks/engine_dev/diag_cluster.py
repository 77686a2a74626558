import sys, torch
sys.path.insert(0, "benchmarks/engine_dev")
from common import load_module, launch, tile_order
mk = load_module(sys.argv[1])
M=N=K=8192
A=torch.randn(M,K,device='cuda').bfloat16(); B=torch.randn(K,N,device='cuda').bfloat16(); C=torch.empty(M,N,device='cuda',dtype=torch.bfloat16)
for cfg in (0,3):
    o=tile_order(mk,M,N,cfg,132)
    for order in (o, None):
        launch(mk,A,B,C,M,N,K,config=cfg,order=order); torch.cuda.synchronize()
        s=torch.cuda.Event(enable_timing=True); e=torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(20): launch(mk,A,B,C,M,N,K,config=cfg,order=order)
        e.record(); torch.cuda.synchronize()
        ms=s.elapsed_time(e)/20
        print(f"cfg{cfg} order={'grouped' if order is not None else 'rowmajor'} grid={mk.gemm_last_grid()} {2*M*N*K/ms/1e9:.0f} TF/s")
