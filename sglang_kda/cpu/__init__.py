"""CPU platform support: what SGLang's CPU engine needs and no registry provides."""
