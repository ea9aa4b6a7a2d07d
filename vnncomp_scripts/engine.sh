# The engine of an instance (sourced by prepare_instance.sh and run_instance.sh):
# CVE_ENGINE when set; else abcrown when ABCROWN_PATH is set or the category's config says
# "engine: abcrown"; else native.
engine_of() {
    local engine="${CVE_ENGINE:-}"
    if [[ -z "$engine" ]]; then
        engine=native
        if [[ -n "${ABCROWN_PATH:-}" ]] || grep -Eq '^[[:space:]]*engine:[[:space:]]*abcrown' "$1"; then
            engine=abcrown
        fi
    fi
    echo "$engine"
}
