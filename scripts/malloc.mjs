// glibc malloc settings for the commands that run an engine. Plain JS: scripts/shoal.mjs imports it
// before it knows whether Node can strip types.
//
// Why: an engine step allocates and frees large transient buffers — onnxruntime's outputs copied
// into new JS buffers (eight rows of a 32,000-token vocabulary are 1 MB a step), KV blocks rebuilt
// when a batch changes. glibc's defaults serve blocks past a moving threshold with mmap and give
// freed memory back to the kernel once the top of a heap has 2× that threshold free, so the next
// step's buffers land on pages never touched, and a first touch costs ~13 µs a page on the VMs we
// measured (docs/engine-notes.md, wave 8). Served eight streams took 9–19 page faults a token.
// With blocks under 32 MB from the heap and freed memory kept (the settings below) they took
// 0.1–5.6, the time between two engine runs halved, and eight streams of the 60m int4 model
// decoded 24 % and 8 % faster in two runs of four alternating pairs (medians; one stream moved
// within its noise, +1 % and −5 %; wave 9, reproduction/ab-serve-env.ts). The price is memory kept
// once freed: peak RSS +0–7 % (250m int4 with a 2,000-token prompt 654/691 vs 646/648 MB; 250m
// fp32 1,222–1,235 vs 1,225). glibc reads GLIBC_TUNABLES once, at process start, so the launcher
// re-executes Node with it (process.execve: same PID, so signals and supervisors see one process).

/** Commands whose process runs an engine. */
export const ENGINE_COMMANDS = new Set(['serve', 'node', 'demo'])

/**
 * Blocks under 32 MiB from the heap; up to 1 GiB of freed heap kept for reuse; and malloc's memory
 * marked for transparent huge pages (`hugetlb=1`: madvise, which a kernel whose THP mode is
 * `madvise` (this project's Debian VMs) honours, `always` does anyway and `never` ignores).
 * Measured (reproduction/ab-serve-env.ts, docs/engine-notes.md, wave 15): 60m fp32 +7 % one
 * stream and eight streams, ahead in 10/10 (one stream) and 9/10 (eight) reps over two sessions;
 * 250m fp32, 60m and 250m int4 unchanged within their noise; peak RSS +0–1 %. glibc marks the main
 * thread's heap and the blocks it maps alone (past the 32 MiB threshold), not a thread's own
 * arena, where the engine worker's onnxruntime packs most weights: of the 60m fp32 model's 162 MB,
 * only the LM head's 65 MB block is in huge pages (/proc/PID/smaps, wave 20). Every thread on the
 * main heap (`arena_max=1`, all weights in huge pages) added nothing measurable (wave 20), so the
 * arenas are left as they are.
 * glibc before 2.35 ignores the key.
 */
export const MALLOC_TUNABLES = 'glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=1073741824:glibc.malloc.hugetlb=1'

/**
 * The GLIBC_TUNABLES to re-execute with (`current`, the one this process has, plus ours), or
 * undefined to run as we are: not a glibc Linux process, not an engine command, or `current`
 * already sets a malloc tunable (the operator's choice, and the mark of the re-executed process).
 */
export function mallocTunables (args, current, runtime) {
  // Cheapest first: `runtime.glibc` may be a getter that generates a diagnostic report (~4 ms).
  if (!ENGINE_COMMANDS.has(args[0] ?? '')) return undefined
  if ((current ?? '').includes('glibc.malloc.')) return undefined
  if (runtime.platform !== 'linux' || runtime.glibc === undefined) return undefined
  return current === undefined || current === '' ? MALLOC_TUNABLES : `${current}:${MALLOC_TUNABLES}`
}

/** The glibc version this process runs on, or undefined (musl, macOS, Windows). */
export function glibcVersion () {
  if (process.platform !== 'linux') return undefined
  try {
    return process.report?.getReport()?.header?.glibcVersionRuntime
  } catch {
    return undefined
  }
}

/**
 * Re-executes this process with the malloc settings when `mallocTunables` asks for them; returns
 * only when it does not (or when this Node has no process.execve: it then runs with glibc's defaults).
 */
export function execWithMallocTunables (script, args) {
  if (typeof process.execve !== 'function') return
  // glibc's version is asked for only by an engine command not yet re-executed (other commands,
  // and the re-executed process, start without the report).
  const tunables = mallocTunables(args, process.env.GLIBC_TUNABLES, { platform: process.platform, get glibc () { return glibcVersion() } })
  if (tunables === undefined) return
  try {
    process.execve(process.execPath, [process.execPath, ...process.execArgv, script, ...args], { ...process.env, GLIBC_TUNABLES: tunables })
  } catch (err) {
    // Only a failed exec returns here: run on with glibc's defaults (slower, nothing else).
    process.stderr.write(`shoal: could not re-execute with malloc tunables (${err.message}); running with glibc's defaults\n`)
  }
}
