"""Mirrors tt-metal's package models/common/ (only the modules ttserve imports from it are faked here)."""
