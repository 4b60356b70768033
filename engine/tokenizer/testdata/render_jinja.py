#!/usr/bin/python3
"""Renders chat templates with Jinja2 exactly as transformers' apply_chat_template does.

The reference for chat_template_test.cc (run with Debian's /usr/bin/python3 and python3-jinja2):

  /usr/bin/python3 render_jinja.py < request.json > renders.json

request.json: {"jobs": [{"template": str, "bos_token": str|null, "eos_token": str|null,
"messages": [...], "tools": [...]|null, "add_generation_prompt": bool, "kwargs": {...}}, ...]}
renders.json: [{"text": str} or {"error": str}, ...], one per job.

Environment as in transformers (chat_template_utils._compile_jinja_template):
ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]),
a tojson filter that is json.dumps(ensure_ascii=False) with the key order kept, and
raise_exception raising TemplateError. Variables as apply_chat_template passes them: messages,
tools, documents (None), add_generation_prompt, the special tokens that are set, the kwargs.
"""
import json
import sys

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def main():
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    request = json.load(sys.stdin)
    out = []
    compiled = {}
    for job in request["jobs"]:
        try:
            source = job["template"]
            if source not in compiled:
                compiled[source] = env.from_string(source)
            special = {k: job[k] for k in ("bos_token", "eos_token") if job.get(k)}
            text = compiled[source].render(
                messages=job["messages"], tools=job.get("tools"), documents=None,
                add_generation_prompt=job.get("add_generation_prompt", False),
                **special, **job.get("kwargs", {}))
            out.append({"text": text})
        except Exception as e:  # the C++ side only needs to know that it failed
            out.append({"error": "%s: %s" % (type(e).__name__, e)})
    json.dump(out, sys.stdout, ensure_ascii=False)


if __name__ == "__main__":
    main()
