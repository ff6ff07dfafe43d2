#!/bin/sh
exec python3 "$(dirname "$0")/gpu_check.py" "$@"
