"""One file per format. Importing this package registers LowBit's own layouts with comfy-kitchen."""
