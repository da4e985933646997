"""Why bf16 moments round stochastically and int8 moments to nearest: Adam moments of a
stream of gradients that shrink 100x over the run (per-element scales over 3 decades), kept
in fp32 and in each encoding, compared at the end (docs/moments.md, "Rounding"; figures in benchmarks/RESULTS.md).

    PYTHONPATH=. python benchmarks/moment_rounding.py [steps]
"""
import torch, sys
from statestore.kernels import _quant as Q
torch.manual_seed(0)
N=256*64; T=int(sys.argv[1]) if len(sys.argv)>1 else 3000
b1,b2=0.9,0.999
base = 10**(-3*torch.rand(N))          # per-element gradient scale over 3 decades
res={}
for kind in ["fp32","bf16","int8"]:
  for rnd in (["-"] if kind=="fp32" else ["nearest","stochastic"]):
    g_=torch.Generator().manual_seed(1)
    m=torch.zeros(N); v=torch.zeros(N)
    cm=cv=None
    for t in range(1,T+1):
        decay = 10**(-2*t/T)               # gradients shrink 100x over the run
        g = torch.randn(N,generator=g_)*base*decay
        m = m + (1-b1)*(g-m); v = b2*v + (1-b2)*g*g
        if kind!="fp32":
            c,s=Q.encode(kind,0,m,seed=Q.moment_seed("p",0,t),rounding=rnd); m=Q.decode(kind,0,c,s)
            c,s=Q.encode(kind,1,v,seed=Q.moment_seed("p",1,t),rounding=rnd); v=Q.decode(kind,1,c,s)
    res[(kind,rnd)]=(m.clone(),v.clone())
fm,fv=res[("fp32","-")]
print(f"{'moments':18s} {'median |sqrt v - ref|/ref':>26s} {'p90':>8s} {'median |m-ref|/rms(ref)':>24s}")
for k,(m,v) in res.items():
    r=((v.sqrt()-fv.sqrt()).abs()/fv.sqrt())
    e=((m-fm).abs()/fm.pow(2).mean().sqrt())
    print(f"{k[0]+' '+k[1]:18s} {float(r.median()):26.4f} {float(r.quantile(0.9)):8.4f} {float(e.median()):24.4f}")
