"""Mirrors tt-metal's package models/demos/llama3_70b_galaxy/tt/ (only the modules ttserve imports from it are faked here)."""
