"""Hypothesis strategies shared by the escaping tests, pure and under systemd."""

from hypothesis import strategies as st

# Text that mixes the characters systemd treats specially with everything else.
special = st.sampled_from([*"%$\"'\\; \t\n#=@-+!:{}", "\u2028", "\x00", "\x7f", "🦙"])
values = st.lists(st.one_of(special, st.characters()), max_size=24).map("".join)
env_names = st.from_regex(r"[A-Z][A-Z0-9_]{0,8}", fullmatch=True).filter(
    lambda k: not any(s in k for s in ("TOKEN", "KEY", "SECRET", "PASS", "CRED"))
    and k not in ("VLLM_HOST_IP", "CUDA_VISIBLE_DEVICES", "RAY_ADDRESS"))
