"""Mirrors tt-metal's package models/demos/llama3_70b_galaxy/ (only the modules ttserve imports from it are faked here)."""
