"""Pure builders of chains and chords, and the submit functions apps call."""
