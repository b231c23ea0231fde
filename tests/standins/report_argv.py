#!/usr/bin/python3
"""Writes the argv and environment it was started with to OUT as JSON, then sleeps:
what systemd actually passed, for the exact-argv tests.

    report_argv.py OUT [ARG...]
"""

import json
import os
import sys
import time

out = sys.argv[1]
with open(out + ".tmp", "w", encoding="utf-8") as f:
    json.dump({"argv": sys.argv[2:], "env": dict(os.environ)}, f, ensure_ascii=False)
os.replace(out + ".tmp", out)
while True:
    time.sleep(3600)
