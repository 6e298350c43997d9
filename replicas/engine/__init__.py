"""The engine room: everything that touches llama.cpp and runs on the engine thread."""
