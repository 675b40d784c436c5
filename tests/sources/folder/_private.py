raise RuntimeError("modules whose names start with _ are not loaded")
