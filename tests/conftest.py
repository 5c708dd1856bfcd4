import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

# every conversion of a GGUF model the tests make (and the prepared sets they leave to the default cache) lands in
# one place per checkout, shared by the test workers and runs, never in the user's own cache
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("LIGHTNING_FSDP_CACHE", os.path.join(REPO, ".pytest_cache", "lightning_fsdp"))
