#!/bin/bash -p
# Test double of Huawei hccn_tool, fast front (kimictl sandbox; installed as hccn_tool by
# kimictl/sandbox/cluster.py, with py= set by hccn_tool.front_script).
#
# The Python double at $py is the authority. Whenever host.json or faults.json changes, the sandbox renders
# $KIMI_SIM_DIR/fast/npu<N> with the Python double's own code (hccn_tool.write_fast_state): NUL-terminated
# key=value records holding the exact host.json/faults.json bytes they were rendered from, the answer
# ("<exit code>:<stdout>") to each `-i N <query> -g`, and what a ping from N needs. This front answers
# `-i N <query> -g` and `-i N -ping|-hccs_ping -g address X` from that file, but only while the file
# still embeds the current host.json and faults.json byte for byte; anything else (other argument shapes,
# errors, missing or stale state, addresses it cannot judge against cut_routes) is exec'd to $py.
# It exists because the Python double costs 30-50 ms of CPU a call and preflight makes ~80 calls a host.
# bash -p: no BASH_ENV, no functions from the environment; no variable is exported, so $py and ping see
# the caller's environment unchanged.
py=@HCCN_TOOL_PY@
argv=("$@")
slow() { exec "$py" "${argv[@]}"; }

# argument checks with glob patterns, not =~ (a regcomp each): $2 ^(0|[1-9][0-9]{0,3})$, $3 ^-[a-z_]+$,
# $6 ^[0-9A-Za-z.:_-]+$ (bash >= 5 matches ranges as ASCII whatever the locale: globasciiranges)
if (($# == 4)); then
    [[ $4 == -g ]] || slow
elif (($# == 6)); then
    [[ $4 == -g && $5 == address && -n $6 && $6 != *[!0-9A-Za-z.:_-]* ]] || slow
else
    slow
fi
[[ $1 == -i && ($2 == 0 || ($2 == [1-9]* && $2 != *[!0-9]* && ${#2} -le 4)) ]] || slow
[[ $3 == -?* && ${3:1} != *[!a-z_]* ]] || slow

sim=${KIMI_SIM_DIR:-/var/lib/kimi-sim}
declare -A r
# one buffered read of every record (a `read -d ''` loop costs two syscalls a record); the last record is
# `end`, so a file cut short is not used
mapfile -d '' -t recs 2>/dev/null <"$sim/fast/npu$2"
for rec in "${recs[@]}"; do
    r[${rec%%=*}]=${rec#*=}
done
((${#recs[@]})) && [[ ${recs[-1]} == end=1 && ${r[v]-} == 2 ]] || slow
# read -d '' stops at a NUL byte (status 0): a file with one is not what the answers were rendered from
cur=
IFS= read -r -d '' cur 2>/dev/null <"$sim/host.json" && slow
[[ $cur == "${r[host]-}" ]] || slow
cur=
IFS= read -r -d '' cur 2>/dev/null <"$sim/faults.json" && slow
[[ $cur == "${r[faults]-}" ]] || slow

if (($# == 4)); then
    [[ -n ${r[q$3]-} ]] || slow
    v=${r[q$3]}
    printf '%s' "${v#*:}"
    exit "${v%%:*}"
fi

# a ping, as hccn_tool.ping does it: link-down and (loopback mode) cut_routes block it here, the kernel
# decides the rest
[[ -n ${r[p$3]-} && -n ${r[src]-} ]] || slow
dst=$6
blocked=${r[down]-0}
if [[ $blocked != 1 && -n ${r[cut]-} ]]; then
    [[ $dst =~ ^([0-9]{1,3})\.([0-9]{1,3})\.([0-9]{1,3})\.([0-9]{1,3})$ ]] || slow
    ip=0
    for o in 1 2 3 4; do
        x=$((10#${BASH_REMATCH[o]}))
        ((x <= 255)) || slow
        ip=$((ip * 256 + x))
    done
    read -r -a cut <<<"${r[cut]}"
    for ((k = 0; k + 1 < ${#cut[@]}; k += 2)); do
        (((ip & cut[k + 1]) == cut[k])) && blocked=1
    done
fi
count=3
printf 'device %s PING %s\n' "$2" "$dst"
got=0
if [[ $blocked != 1 ]]; then
    out=$(exec ping -n -c "$count" -i 0.2 -w 2 -W 1 -I "${r[src]}" "$dst" 2>/dev/null)   # exec: one fork, not two
    reply='icmp_seq=([0-9]+).*time=([0-9.]+) ms'
    while IFS= read -r line; do
        [[ $line =~ $reply ]] || continue
        seq=$((10#${BASH_REMATCH[1]} - 1))
        ms=${BASH_REMATCH[2]}
        # Python's f"{float(ms):.6f}", without printf %f (its decimal point follows the locale)
        if [[ $ms =~ ^([0-9]{1,15})(\.([0-9]{0,6}))?$ ]]; then
            frac=${BASH_REMATCH[3]}000000
            ms=$((10#${BASH_REMATCH[1]})).${frac:0:6}
        else
            ms=$(LC_ALL=C printf '%.6f' "$ms")
        fi
        printf 'recv seq=%s,time=%sms\n' "$seq" "$ms"
        got=$((got + 1))
    done <<<"$out"
fi
# loss = 100 * (count - got) / count to 2 decimals: micro-percent, then rounded to hundredths (k/3 is never
# a tie, so this matches Python's correctly rounded :.2f)
micro=$((100000000 * (count - got) / count))
sign=
((micro < 0)) && sign=- micro=$((-micro))
hund=$(((micro + 5000) / 10000))
printf '%d packets transmitted, %d received, %s%d.%02d%% packet loss\n' "$count" "$got" "$sign" \
    $((hund / 100)) $((hund % 100))
((got > 0)) || exit 1
exit 0
