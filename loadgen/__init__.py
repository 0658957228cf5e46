"""`tollgate loadgen`: a bounded load generator with realistic traffic shape.

A client of Tollgate, not a part of it: it imports nothing of Tollgate's packages (an
import-linter contract says so) and speaks HTTP to any OpenAI-compatible server.

Profiles (traffic shape) are data files in `profiles/`; `runner` drives open-loop (fixed arrival
rate, Poisson or bursty) or closed-loop (fixed concurrency) traffic through the official `openai`
SDK or raw httpx; `reconcile` compares the tokens the clients saw with the finance ledger.
"""

# The parts a plain install of Tollgate leaves out, named in the one line that says so.
EXTRA_HINT = "pip install 'tollgate-llm[loadgen]'"
