"""`tollgate loadgen`: a bounded load generator with realistic traffic shape.

Profiles (traffic shape) are data files in `profiles/`; `runner` drives open-loop (fixed arrival
rate, Poisson or bursty) or closed-loop (fixed concurrency) traffic through the official `openai`
SDK or raw httpx; `reconcile` compares the tokens the clients saw with the finance ledger.
"""
