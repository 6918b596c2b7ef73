"""`trajgate demo` and the vLLM CPU harness it, the e2e tier and the benches start vLLM with."""
