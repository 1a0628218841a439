/**
 * llama.cpp as a benchmark dependency: built once from the source that the npm package
 * node-llama-cpp carries (llama/gitRelease.bundle), or taken from a checkout that has a build; the
 * flags of its server and bench that decide what is compared; and llama-bench's engine-only rows.
 */
import { spawnSync } from 'node:child_process'
import { existsSync, readFileSync } from 'node:fs'
import { mkdir, readdir } from 'node:fs/promises'
import { availableParallelism } from 'node:os'
import { join, resolve } from 'node:path'
import { cacheRoot } from '../../scripts/paths.ts'
import { underRt } from './realtime.ts'

/** The shape of a run that llama.cpp's flags follow: threads, parallel streams, prompt, new tokens, long prompt. */
export interface LlamaShape { threads: number, streams: number, prompt: number, tokens: number, long: number }

/** One llama-bench row: `pp128` (prefill) or `tg128` (decode), mean tok/s and its standard deviation. */
export interface BenchRow { test: string, tokS: number, sd: number }

const log = (s: string): void => { process.stderr.write(`${s}\n`) }

function sh (cmd: string, argv: string[], cwd: string): void {
  log(`$ ${cmd} ${argv.join(' ')}   (in ${cwd})`)
  const r = spawnSync(cmd, argv, { cwd, stdio: ['ignore', 'inherit', 'inherit'] })
  if (r.status !== 0) throw new Error(`${cmd} ${argv.join(' ')} failed (${r.status ?? r.signal})`)
}

/** The llama.cpp programs every benchmark here needs; a benchmark names any others it runs. */
const BASE_TOOLS = ['llama-bench', 'llama-server']

/**
 * The bin/ folder with llama-server, llama-bench and `extra` tools (say `llama-batched-bench`):
 * `llamaDir`'s build/bin when given (never built here: someone else's checkout), else
 * $SHOAL_CACHE/llama.cpp/llama.cpp, cloned and built on first use (minutes); a tool it lacks is
 * built into it when first asked for (seconds once the libraries are built).
 */
export async function ensureLlamaCpp (llamaDir: string | undefined, extra: readonly string[] = []): Promise<string> {
  const dir = llamaDir ?? join(cacheRoot(), 'llama.cpp', 'llama.cpp')
  const bin = join(dir, 'build', 'bin')
  const missing = [...BASE_TOOLS, ...extra].filter(t => !existsSync(join(bin, t)))
  if (missing.length === 0) return bin
  if (llamaDir !== undefined) throw new Error(`${bin}: no ${missing.join(', ')} (build them, or drop --llama-dir)`)
  const cache = join(cacheRoot(), 'llama.cpp')
  await mkdir(cache, { recursive: true })
  if (!existsSync(join(dir, 'CMakeLists.txt'))) {
    const bundle = join(cache, 'package', 'llama', 'gitRelease.bundle')
    if (!existsSync(bundle)) {
      sh('npm', ['pack', 'node-llama-cpp', '--silent'], cache)
      const tgz = (await readdir(cache)).find(f => /^node-llama-cpp-.*\.tgz$/.test(f))
      if (tgz === undefined) throw new Error(`npm pack node-llama-cpp left no tarball in ${cache}`)
      sh('tar', ['-xzf', tgz, 'package/llama/gitRelease.bundle'], cache)
    }
    sh('git', ['clone', '--quiet', bundle, dir], cache)
  }
  sh('cmake', ['-B', 'build', '-DCMAKE_BUILD_TYPE=Release', '-DLLAMA_CURL=OFF', ...isaFlags(), '-DLLAMA_BUILD_TESTS=OFF', '-DLLAMA_BUILD_EXAMPLES=OFF'], dir)
  sh('cmake', ['--build', 'build', `-j${availableParallelism()}`, '--target', ...missing], dir)
  return bin
}

/**
 * GGML_NATIVE, except on CPUs that report AMX: some VMs (this project's 2-core Xeon among them)
 * list amx_tile in cpuid, grant the permission, and still fault on the first tileloadd, so
 * llama.cpp's Q4_0 matmul dies with SIGILL. There every ISA extension ggml uses is named instead,
 * AMX left out.
 */
export function isaFlags (cpuinfo = readFileSync('/proc/cpuinfo', 'utf8')): string[] {
  const flags = new Set(/^flags\s*:(.*)$/m.exec(cpuinfo)?.[1]?.trim().split(/\s+/) ?? [])
  if (!flags.has('amx_tile')) return ['-DGGML_NATIVE=ON']
  const on = (flag: string, opt: string): string => `-DGGML_${opt}=${flags.has(flag) ? 'ON' : 'OFF'}`
  return ['-DGGML_NATIVE=OFF', on('sse4_2', 'SSE42'), on('avx', 'AVX'), on('avx2', 'AVX2'), on('fma', 'FMA'), on('f16c', 'F16C'), on('bmi2', 'BMI2'),
    on('avx_vnni', 'AVX_VNNI'), on('avx512bw', 'AVX512'), on('avx512vbmi', 'AVX512_VBMI'), on('avx512_vnni', 'AVX512_VNNI'), on('avx512_bf16', 'AVX512_BF16'),
    '-DGGML_AMX_TILE=OFF', '-DGGML_AMX_INT8=OFF', '-DGGML_AMX_BF16=OFF']
}

/** Environment of llama.cpp processes: `--llama-lib DIR` puts other ggml libraries (say, built without AMX) ahead of the build's RUNPATH. */
export function llamaEnv (lib: string | undefined): NodeJS.ProcessEnv {
  if (lib === undefined) return process.env
  return { ...process.env, LD_LIBRARY_PATH: [resolve(lib), process.env.LD_LIBRARY_PATH].filter(x => x !== undefined && x !== '').join(':') }
}

/**
 * llama.cpp's attention precision. `default`: llama.cpp's own (f16 KV cache, flash attention
 * auto, which rounds through f16 on the CPU) — what its users run, and what the speed figures use.
 * `exact`: beside F32 weights an f32 cache and no flash attention — shoal's precision; with it the
 * greedy tokens equal shoal's (tiny and 60m: 128 of 128, alone and 8 batched), with the defaults
 * they part after a few dozen, by rounding alone. Its cost: without flash attention llama-server's
 * prefill grows with every KV cell its unified cache has touched since start (cells are taken
 * further along, and attention spans up to the highest used one), so `exact` is for checking
 * tokens (`--verify-only --llama-kv exact`), not for timing. `f16|f32|q8_0`: that cache type, both.
 */
export function kvArgs (kv: string, quant: 'none' | 'int4', bench = false): string[] {
  // llama-bench takes no f32 cache type (f16, bf16 and quantized ones only): it keeps its f16 cache.
  if (kv === 'default') return []
  if (kv === 'exact') return quant === 'none' ? [...(bench ? [] : ['-ctk', 'f32', '-ctv', 'f32']), '-fa', 'off'] : []
  return bench && kv === 'f32' ? [] : ['-ctk', kv, '-ctv', kv]
}

/** The llama-server flags: CPU, `threads` threads, `streams` slots sharing one KV buffer big enough for every prompt of the run. */
export function llamaServerArgs (gguf: string, port: number, shape: LlamaShape): string[] {
  const { threads, streams, prompt, tokens, long } = shape
  const ctx = Math.max(streams * (prompt + tokens + 16), long + tokens + 16)
  return ['-m', gguf, '--host', '127.0.0.1', '--port', String(port), '-t', String(threads), '-tb', String(threads),
    '-c', String(ctx), '-np', String(streams), '--kv-unified', '-ngl', '0', '--no-cache-prompt', '-cram', '0', '--no-webui', '--log-disable']
}

/** llama-bench pp`prompt` / tg`tokens` on `gguf`, `reps` repetitions, under RT when this process is realtime. */
export function llamaBench (bin: string, gguf: string, shape: LlamaShape, reps: string, extra: string[], env: NodeJS.ProcessEnv): BenchRow[] {
  const [cmd, argv] = underRt(join(bin, 'llama-bench'), ['-m', gguf, '-p', String(shape.prompt), '-n', String(shape.tokens), '-t', String(shape.threads), '-r', reps, ...extra, '-o', 'json'])
  const r = spawnSync(cmd, argv, { encoding: 'utf8', maxBuffer: 64 << 20, env })
  if (r.status !== 0) throw new Error(`llama-bench failed (${r.status ?? r.signal}): ${r.stderr.slice(-2000)}`)
  const rows = JSON.parse(r.stdout) as Array<{ n_prompt: number, n_gen: number, avg_ts: number, stddev_ts: number }>
  return rows.map(x => ({ test: x.n_gen > 0 ? `tg${x.n_gen}` : `pp${x.n_prompt}`, tokS: x.avg_ts, sd: x.stddev_ts }))
}

/** One llama-batched-bench row: `pl` sequences of `pp` prompt tokens, then `tg` steps of `pl` tokens; seconds. */
export interface BatchedRow { pl: number, pp: number, tg: number, tPp: number, tTg: number }

/**
 * llama-batched-bench's flags over `batches` (its -npl): each row prefills that many prompts of
 * `prompt` tokens as one batch (-b 2048 / -ub 512, llama-server's defaults), then decodes `tokens`
 * steps of one token a sequence; one unified KV buffer big enough for the largest row, llama.cpp's
 * default f16 cache and attention, as llamaServerArgs' server. It samples nothing.
 */
export function llamaBatchedBenchArgs (gguf: string, threads: number, prompt: number, tokens: number, batches: readonly number[]): string[] {
  const ctx = Math.max(...batches) * (prompt + tokens) + 16
  return ['-m', gguf, '-c', String(ctx), '-b', '2048', '-ub', '512', '-npp', String(prompt), '-ntg', String(tokens),
    '-npl', batches.join(','), '-t', String(threads), '-tb', String(threads), '--kv-unified', '-ngl', '0', '--output-format', 'jsonl']
}

/**
 * The rows of llama-batched-bench's `--output-format jsonl` (its other lines are not JSON). A line
 * cut short is skipped: llama.cpp's log thread can lose the end of its output at exit, and the
 * caller, who knows which rows it asked for, sees the row missing. A whole row without a number
 * it needs is an error (another llama.cpp's format).
 */
export function parseBatchedBench (stdout: string): BatchedRow[] {
  return stdout.split('\n').filter(l => l.startsWith('{')).flatMap(l => {
    let x: Record<string, unknown>
    try { x = JSON.parse(l) as Record<string, unknown> } catch { return [] }
    const num = (k: string): number => {
      const v = x[k]
      if (typeof v !== 'number' || !Number.isFinite(v)) throw new Error(`llama-batched-bench row without a number ${k}: ${l}`)
      return v
    }
    return [{ pl: num('pl'), pp: num('pp'), tg: num('tg'), tPp: num('t_pp'), tTg: num('t_tg') }]
  })
}

/**
 * The timed rows of a llama-batched-bench call asked for one untimed row first. A fresh process's
 * first row runs on cold caches and pages (60m Q4_0, one row: a 30 ms prefill, against 19.5 ms for
 * the same row later in the same process), while shoal's side is timed warm; so the caller asks for
 * a warm-up row ahead of the rows it times and this drops it. A row that llama.cpp's log thread
 * printed twice (the same numbers, one after the other) counts once.
 */
export function timedBatchedRows (rows: readonly BatchedRow[]): BatchedRow[] {
  const same = (a: BatchedRow, b: BatchedRow): boolean => a.pl === b.pl && a.tPp === b.tPp && a.tTg === b.tTg
  return rows.filter((r, i) => i === 0 || !same(r, rows[i - 1]!)).slice(1)
}

/** llama-batched-bench (`tool`) under RT when this process is realtime; its rows. */
export function llamaBatchedBench (tool: string, gguf: string, threads: number, prompt: number, tokens: number, batches: readonly number[], env: NodeJS.ProcessEnv): BatchedRow[] {
  const [cmd, argv] = underRt(tool, llamaBatchedBenchArgs(gguf, threads, prompt, tokens, batches))
  const r = spawnSync(cmd, argv, { encoding: 'utf8', maxBuffer: 64 << 20, env })
  if (r.status !== 0) throw new Error(`llama-batched-bench failed (${r.status ?? r.signal}): ${r.stderr.slice(-2000)}`)
  return parseBatchedBench(r.stdout)
}
