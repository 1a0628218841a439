/**
 * shoal against llama.cpp on the same CPU and the same weights (issue 11's proof). Generated Llama
 * checkpoints (random weights, real shapes: tiny, 60m, 250m; shards/testmodel, seed 1) are served
 * three ways, one process at a time, with this process as the only client:
 *  - `llama-bench` (engine only: pp128 / tg128, -t 2);
 *  - `llama-server` on a GGUF written from the same tensors (reproduction/gguf.ts): F32, and Q4_0
 *    (ggml's reference quantizer) for every 2-D weight including the output matrix;
 *  - `shoal serve` on the shards compiled from the checkpoint (--quant none / int4).
 * Both servers get the same OpenAI /v1/completions requests: token-id prompts, greedy, streamed;
 * llama-server with `ignore_eos` and `cache_prompt: false` (and `--no-cache-prompt -cram 0`), shoal
 * with `--kv-cache-mb 0` (no prefix reuse) — every prompt is prefilled cold; shoal stops at EOS
 * (the random weights damp EOS, and token counts are measured, not assumed). Per server run:
 * decode tok/s of one stream (128-token prompt), aggregate tok/s of N concurrent streams, TTFT of a
 * cold 128- and 2,000-token prompt (max_tokens 1), peak RSS (VmHWM) against the weight bytes.
 * Server runs alternate (llama, shoal, shoal, llama, ...) so drifting machine load hits both alike.
 * Correctness first: the greedy token ids of the two servers are compared (they must be equal for
 * F32 / fp32 at equal precision, `--llama-kv exact`, or the comparison is not like for like; Q4_0
 * and shoal's int4 quantize differently, so their tokens part early).
 *
 * llama.cpp is a benchmark dependency only: built once from the source that the npm package
 * node-llama-cpp carries (llama/gitRelease.bundle) into $SHOAL_CACHE/llama.cpp (else
 * ~/.cache/shoal/llama.cpp), or taken from `--llama-dir DIR` (a checkout with build/bin/);
 * `--llama-lib DIR` loads the ggml libraries from DIR instead (LD_LIBRARY_PATH), e.g. a ggml-cpu
 * built without AMX where AMX faults (see isaFlags).
 *
 *   node reproduction/bench-vs-llamacpp.ts [--llama-dir DIR] [--sizes tiny,60m,250m]
 *     [--quants none,int4] [--reps 2] [--tokens 128] [--streams 8] [--long 2000] [--verify-only]
 *     [--llama-kv default|exact|f16|f32]   (see kvArgs; check fp32 tokens with --verify-only --llama-kv exact)
 *     [--prepare-only]   (generate, compile and write the models, nothing else)
 *     [--skip-ids]       (no untimed pass for the greedy ids: timing only)
 *     [--temperature T]  (timed requests sample at T over the whole vocabulary; default 0, greedy)
 * Models, shards and GGUF files are made once under .cache/bench-vs-llamacpp/ and reused.
 */
import { spawn, spawnSync } from 'node:child_process'
import type { ChildProcess } from 'node:child_process'
import { existsSync, readFileSync } from 'node:fs'
import { mkdir, mkdtemp, readdir, readFile, rename, rm, writeFile } from 'node:fs/promises'
import { createServer } from 'node:net'
import { availableParallelism, tmpdir, totalmem } from 'node:os'
import { join, resolve } from 'node:path'
import { performance } from 'node:perf_hooks'
import { createInterface } from 'node:readline'
import { setTimeout as sleep } from 'node:timers/promises'
import { parseArgs } from 'node:util'
import { COMPILER_VERSION, compileShards, generateTestModel, loadManifest } from '../shards/index.ts'
import type { TestModelSize } from '../shards/index.ts'
import { cacheRoot } from '../scripts/paths.ts'
import { checkpointToGguf } from './gguf.ts'
import { sseEvents } from './sse.ts'
import { loadAverage, promptIds } from './lib/index.ts'

const { values: args } = parseArgs({
  options: {
    'llama-dir': { type: 'string' },
    'llama-lib': { type: 'string' },
    'llama-kv': { type: 'string', default: 'default' },
    sizes: { type: 'string', default: 'tiny,60m,250m' },
    quants: { type: 'string', default: 'none,int4' },
    reps: { type: 'string', default: '2' },
    tokens: { type: 'string', default: '128' },
    streams: { type: 'string', default: '8' },
    prompt: { type: 'string', default: '128' },
    long: { type: 'string', default: '2000' },
    'bench-reps': { type: 'string', default: '3' },
    threads: { type: 'string', default: String(availableParallelism()) },
    'verify-only': { type: 'boolean', default: false },
    'prepare-only': { type: 'boolean', default: false },
    'skip-ids': { type: 'boolean', default: false },
    // Extra arguments for `shoal serve`, space-separated (e.g. "--draft none" to compare with the default prompt lookup).
    'shoal-args': { type: 'string', default: '' },
    // Timed requests sample at this temperature (0: greedy). Both servers draw from the whole
    // vocabulary: llama-server with its top-k, top-p, min-p and typical-p filters off.
    temperature: { type: 'string', default: '0' },
  },
})
const REPS = Number(args.reps)
const TOKENS = Number(args.tokens)
const STREAMS = Number(args.streams)
const PROMPT = Number(args.prompt)
const TEMPERATURE = Number(args.temperature)
const LONG = Number(args.long)
const THREADS = Number(args.threads)
const REPO = resolve(import.meta.dirname, '..')
const WORK = join(REPO, '.cache', 'bench-vs-llamacpp')
const SHOAL_BIN = join(REPO, 'scripts', 'shoal.mjs')

/** Deterministic prompt token ids inside the test tokenizer's 512 real tokens, clear of the specials at the top. */
const log = (s: string): void => { process.stderr.write(`${s}\n`) }

// ---------------------------------------------------------------------------------------------
// llama.cpp: built once from node-llama-cpp's bundled source.

function sh (cmd: string, argv: string[], cwd: string): void {
  log(`$ ${cmd} ${argv.join(' ')}   (in ${cwd})`)
  const r = spawnSync(cmd, argv, { cwd, stdio: ['ignore', 'inherit', 'inherit'] })
  if (r.status !== 0) throw new Error(`${cmd} ${argv.join(' ')} failed (${r.status ?? r.signal})`)
}

async function ensureLlamaCpp (): Promise<string> {
  const dir = args['llama-dir'] ?? join(cacheRoot(), 'llama.cpp', 'llama.cpp')
  const bin = join(dir, 'build', 'bin')
  if (existsSync(join(bin, 'llama-server')) && existsSync(join(bin, 'llama-bench'))) return bin
  if (args['llama-dir'] !== undefined) throw new Error(`${bin}: no llama-server and llama-bench (build them, or drop --llama-dir)`)
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
  sh('cmake', ['--build', 'build', `-j${availableParallelism()}`, '--target', 'llama-bench', 'llama-server'], dir)
  return bin
}

/**
 * GGML_NATIVE, except on CPUs that report AMX: some VMs (this project's 2-core Xeon among them)
 * list amx_tile in cpuid, grant the permission, and still fault on the first tileloadd, so
 * llama.cpp's Q4_0 matmul dies with SIGILL. There every ISA extension ggml uses is named instead,
 * AMX left out.
 */
function isaFlags (): string[] {
  const flags = new Set(/^flags\s*:(.*)$/m.exec(readFileSync('/proc/cpuinfo', 'utf8'))?.[1]?.trim().split(/\s+/) ?? [])
  if (!flags.has('amx_tile')) return ['-DGGML_NATIVE=ON']
  const on = (flag: string, opt: string): string => `-DGGML_${opt}=${flags.has(flag) ? 'ON' : 'OFF'}`
  return ['-DGGML_NATIVE=OFF', on('sse4_2', 'SSE42'), on('avx', 'AVX'), on('avx2', 'AVX2'), on('fma', 'FMA'), on('f16c', 'F16C'), on('bmi2', 'BMI2'),
    on('avx_vnni', 'AVX_VNNI'), on('avx512bw', 'AVX512'), on('avx512vbmi', 'AVX512_VBMI'), on('avx512_vnni', 'AVX512_VNNI'), on('avx512_bf16', 'AVX512_BF16'),
    '-DGGML_AMX_TILE=OFF', '-DGGML_AMX_INT8=OFF', '-DGGML_AMX_BF16=OFF']
}

/** Environment of llama.cpp processes: `--llama-lib DIR` puts other ggml libraries (say, built without AMX) ahead of the build's RUNPATH. */
function llamaEnv (): NodeJS.ProcessEnv {
  const lib = args['llama-lib']
  if (lib === undefined) return process.env
  return { ...process.env, LD_LIBRARY_PATH: [resolve(lib), process.env.LD_LIBRARY_PATH].filter(x => x !== undefined && x !== '').join(':') }
}

// ---------------------------------------------------------------------------------------------
// Models: one checkpoint per size; shoal shards per quant; GGUF per quant.

interface ModelFiles { size: string, quant: 'none' | 'int4', shards: string, modelId: string, gguf: string, shoalWeightBytes: number, ggufWeightBytes: number }

async function once (target: string, make: (tmp: string) => Promise<unknown>): Promise<void> {
  if (existsSync(target)) return
  const tmp = `${target}.tmp-${process.pid}`
  const t = performance.now()
  await make(tmp)
  await rename(tmp, target)
  log(`made ${target} in ${((performance.now() - t) / 1000).toFixed(1)} s`)
}

async function ensureModel (size: TestModelSize, quant: 'none' | 'int4'): Promise<ModelFiles> {
  await mkdir(WORK, { recursive: true })
  const ckpt = join(WORK, `llama-${size}`)
  await once(ckpt, async tmp => { await generateTestModel({ architecture: 'llama', size, outDir: tmp, seed: 1 }) })
  const modelId = `llama-${size}-${quant === 'none' ? 'fp32' : quant}`
  // Named by compiler version: shards compiled by an older shoal are never measured as the newest.
  const shards = join(WORK, `${modelId}-c${COMPILER_VERSION}`)
  await once(shards, async tmp => await compileShards({ modelDir: ckpt, outDir: tmp, quant, modelId }))
  const gguf = join(WORK, `llama-${size}-${quant === 'none' ? 'f32' : 'q4_0'}.gguf`)
  await once(gguf, async tmp => {
    const bytes = await checkpointToGguf(ckpt, tmp, quant === 'none' ? 'f32' : 'q4_0')
    await writeFile(`${gguf}.bytes`, `${bytes}\n`)
  })
  const manifest = await loadManifest(shards)
  const shoalWeightBytes = manifest.stages[0]!.files.reduce((a, f) => a + f.bytes, 0)
  return { size, quant, shards, modelId, gguf, shoalWeightBytes, ggufWeightBytes: Number(await readFile(`${gguf}.bytes`, 'utf8')) }
}

// ---------------------------------------------------------------------------------------------
// Servers: one child process at a time; peak RSS read from /proc before it is stopped.

interface Server { kind: 'llama' | 'shoal', url: string, model: string, child: ChildProcess, startMs: number }

/**
 * Under a realtime policy (`chrt -r N node ...`, which keeps other users' work on a shared machine
 * from preempting the measurement), servers and llama-bench run one priority below this process:
 * a server's threads at the client's own priority could hold both cores for a whole RR quantum
 * while the client waits to read a chunk.
 */
function rtPrefix (): string[] {
  const out = spawnSync('chrt', ['-p', String(process.pid)], { encoding: 'utf8' }).stdout ?? ''
  const policy = /policy: (SCHED_\w+)/.exec(out)?.[1]
  const prio = Number(/priority: (\d+)/.exec(out)?.[1] ?? 0)
  if ((policy !== 'SCHED_RR' && policy !== 'SCHED_FIFO') || prio < 2) return []
  return ['chrt', policy === 'SCHED_RR' ? '-r' : '-f', String(prio - 1)]
}
const RT = rtPrefix()

/** spawn(), under RT when this process is realtime (chrt execs: the pid is the program's). */
function spawnRt (cmd: string, argv: string[], options: Parameters<typeof spawn>[2]): ChildProcess {
  return RT.length === 0 ? spawn(cmd, argv, options) : spawn(RT[0]!, [...RT.slice(1), cmd, ...argv], options)
}

async function freePort (): Promise<number> {
  return await new Promise((resolve, reject) => {
    const s = createServer()
    s.once('error', reject)
    s.listen(0, '127.0.0.1', () => {
      const port = (s.address() as { port: number }).port
      s.close(() => { resolve(port) })
    })
  })
}

function tailOf (child: ChildProcess): () => string {
  let err = ''
  const keep = (b: Buffer): void => { err = (err + b.toString()).slice(-4000) }
  child.stderr?.on('data', keep)
  return () => err
}

async function waitHttp (url: string, ok: (status: number, body: string) => boolean, child: ChildProcess, tail: () => string, boundMs: number): Promise<void> {
  const until = Date.now() + boundMs
  for (;;) {
    if (child.exitCode !== null || child.signalCode !== null) throw new Error(`server exited (${child.exitCode ?? child.signalCode}): ${tail()}`)
    try {
      const res = await fetch(url, { signal: AbortSignal.timeout(5000) })
      if (ok(res.status, await res.text())) return
    } catch { /* not up yet */ }
    if (Date.now() > until) throw new Error(`${url} not ready within ${boundMs} ms: ${tail()}`)
    await sleep(100)
  }
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
function kvArgs (m: ModelFiles, bench = false): string[] {
  // llama-bench takes no f32 cache type (f16, bf16 and quantized ones only): it keeps its f16 cache.
  const kv = args['llama-kv']
  if (kv === 'default') return []
  if (kv === 'exact') return m.quant === 'none' ? [...(bench ? [] : ['-ctk', 'f32', '-ctv', 'f32']), '-fa', 'off'] : []
  return bench && kv === 'f32' ? [] : ['-ctk', kv, '-ctv', kv]
}

/** The llama-server flags: CPU, THREADS threads, STREAMS slots sharing one KV buffer big enough for every prompt here. */
function llamaServerArgs (gguf: string, port: number): string[] {
  const ctx = Math.max(STREAMS * (PROMPT + TOKENS + 16), LONG + TOKENS + 16)
  return ['-m', gguf, '--host', '127.0.0.1', '--port', String(port), '-t', String(THREADS), '-tb', String(THREADS),
    '-c', String(ctx), '-np', String(STREAMS), '--kv-unified', '-ngl', '0', '--no-cache-prompt', '-cram', '0', '--no-webui', '--log-disable']
}

async function startLlama (bin: string, m: ModelFiles): Promise<Server> {
  const port = await freePort()
  const t = performance.now()
  const child = spawnRt(join(bin, 'llama-server'), [...llamaServerArgs(m.gguf, port), ...kvArgs(m)], { stdio: ['ignore', 'ignore', 'pipe'], env: llamaEnv() })
  const tail = tailOf(child)
  const url = `http://127.0.0.1:${port}`
  await waitHttp(`${url}/health`, s => s === 200, child, tail, 300_000)
  return { kind: 'llama', url, model: m.modelId, child, startMs: performance.now() - t }
}

async function startShoal (m: ModelFiles, cache: string): Promise<Server> {
  const t = performance.now()
  const child = spawnRt(process.execPath, [SHOAL_BIN, 'serve', '--model', m.shards, '--api', '127.0.0.1:0', '--device', 'cpu', '--kv-cache-mb', '0', ...args['shoal-args'].split(' ').filter(a => a.length > 0)],
    { stdio: ['ignore', 'pipe', 'pipe'], env: { ...process.env, SHOAL_CACHE: cache } })
  const tail = tailOf(child)
  const url = await new Promise<string>((resolve, reject) => {
    const timer = setTimeout(() => { reject(new Error(`shoal serve did not start within 300 s: ${tail()}`)) }, 300_000)
    child.once('exit', code => { clearTimeout(timer); reject(new Error(`shoal serve exited (${code}): ${tail()}`)) })
    createInterface({ input: child.stdout! }).on('line', line => {
      const match = /^shoal: serving \S+ at (\S+)\/v1/.exec(line)
      if (match !== null) { clearTimeout(timer); resolve(match[1]!) }
    })
  })
  await waitHttp(`${url}/v1/models`, (s, body) => s === 200 && body.includes(m.modelId), child, tail, 300_000)
  return { kind: 'shoal', url, model: m.modelId, child, startMs: performance.now() - t }
}

function peakRss (child: ChildProcess): number {
  try {
    const m = /VmHWM:\s+(\d+) kB/.exec(readFileSync(`/proc/${child.pid}/status`, 'utf8'))
    return m === null ? NaN : Number(m[1]) * 1024
  } catch { return NaN }
}

async function stop (s: Server): Promise<void> {
  if (s.child.exitCode !== null || s.child.signalCode !== null) return
  const exited = new Promise<void>(resolve => { s.child.once('exit', () => { resolve() }) })
  s.child.kill('SIGTERM')
  if (await Promise.race([exited.then(() => true), sleep(10_000).then(() => false)])) return
  s.child.kill('SIGKILL')
  await exited
}

// ---------------------------------------------------------------------------------------------
// Client: the same streamed /v1/completions request to both servers.

/** 429s answered (and retried after their Retry-After, as the openai client does) per server run. */
const refused = new Map<Server, number>()

/** POST JSON; a 429 is waited out (Retry-After) and retried, inside the request's time. */
async function post (s: Server, path: string, body: unknown): Promise<Response> {
  for (let attempt = 0; ; attempt++) {
    const res = await fetch(`${s.url}${path}`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify(body), signal: AbortSignal.timeout(600_000) })
    if (res.status === 200) return res
    const text = await res.text()
    if (res.status !== 429 || attempt >= 30) throw new Error(`${s.kind}: HTTP ${res.status}: ${text}`)
    refused.set(s, (refused.get(s) ?? 0) + 1)
    await sleep(1000 * Math.max(0.1, Number(res.headers.get('retry-after') ?? 1)))
  }
}

interface Completion { count: number, t0: number, first: number, last: number, end: number }

/**
 * One streamed greedy completion, timed where the client sees tokens. Both servers hold back a
 * token whose text ends inside a UTF-8 character; shoal then sends the held ids with the next
 * chunk (return_token_ids), llama-server sends only the newest id but counts every token
 * (`tokens_predicted` under `__verbose`). So tokens are counted, not collected, here; the ids are
 * compared by `greedyIds` below. A completion whose only token is held arrives with the final
 * chunk: that chunk's time is its first token's.
 */
async function complete (s: Server, prompt: number[], maxTokens: number): Promise<Completion> {
  const body: Record<string, unknown> = { model: s.model, prompt, max_tokens: maxTokens, temperature: TEMPERATURE, top_p: 1, seed: prompt.length + maxTokens, stream: true }
  if (s.kind === 'shoal') body.return_token_ids = true
  else Object.assign(body, { ignore_eos: true, cache_prompt: false, verbose: true, top_k: 0, min_p: 0, typical_p: 1 })
  const t0 = performance.now()
  const res = await post(s, '/v1/completions', body)
  let count = 0
  let first = NaN
  let last = NaN
  for await (const event of sseEvents(res.body)) {
    const line = event.split('\n').find(l => l.startsWith('data: {'))
    if (line === undefined) continue
    const data = JSON.parse(line.slice(6)) as { error?: unknown, choices?: Array<{ token_ids?: number[], finish_reason?: string | null }>, __verbose?: { tokens_predicted?: number } }
    if (data.error !== undefined) throw new Error(`${s.kind}: stream error: ${JSON.stringify(data.error)}`)
    const n = s.kind === 'shoal' ? count + (data.choices?.[0]?.token_ids?.length ?? 0) : Math.max(count, data.__verbose?.tokens_predicted ?? 0)
    const finished = (data.choices?.[0]?.finish_reason ?? null) !== null
    if (n === count && !(finished && Number.isNaN(first))) continue
    const now = performance.now()
    if (Number.isNaN(first)) first = now
    if (n > count) last = now
    count = n
  }
  if (count === 0) throw new Error(`${s.kind}: no tokens came back`)
  return { count, t0, first, last, end: performance.now() }
}

/**
 * The greedy ids of a non-streamed completion (shoal: /v1/completions return_token_ids;
 * llama-server: /completion return_tokens, the one route that lists every id). Untimed.
 */
async function greedyIds (s: Server, prompt: number[], maxTokens: number): Promise<number[]> {
  const [path, body] = s.kind === 'shoal'
    ? ['/v1/completions', { model: s.model, prompt, max_tokens: maxTokens, temperature: 0, return_token_ids: true }]
    : ['/completion', { prompt, n_predict: maxTokens, temperature: 0, ignore_eos: true, cache_prompt: false, return_tokens: true }]
  const res = await post(s, path, body)
  const data = await res.json() as { tokens?: number[], choices?: Array<{ token_ids?: number[] }> }
  return (s.kind === 'shoal' ? data.choices?.[0]?.token_ids : data.tokens) ?? []
}

interface SessionResult {
  kind: 'llama' | 'shoal'
  startMs: number
  /**
   * Single stream: ids (untimed run), tokens, decode tok/s end to end — (tokens − 1) / (the whole
   * request's time − the whole time of a max_tokens-1 request with an equally long prompt) — and,
   * for reference, timed between the first and the last chunk.
   */
  singleIds: number[]
  singleTokens: number
  singleDecode: number
  singleDecodeChunks: number
  /** STREAMS concurrent streams: all tokens / wall time from the first request to the last response's end; each stream's ids. */
  multiTokS: number
  multiTokens: number
  multiIds: number[][]
  multiWallS: number
  /** TTFT: a max_tokens-1 request's whole time (request sent to response ended). */
  ttftShortMs: number
  /** 429s waited out and retried during the timed requests. */
  refusedTimed: number
  ttftLongMs: number
  peakRss: number
}

async function session (s: Server, rep: number, verify: boolean): Promise<SessionResult> {
  await complete(s, promptIds(16, 999), 8) // warm-up: first session run, JIT, thread pools
  const single = await complete(s, promptIds(PROMPT, 1), TOKENS)
  const t = performance.now()
  const multi = await Promise.all(Array.from({ length: STREAMS }, async (_, i) => await complete(s, promptIds(PROMPT, 10 + i), TOKENS)))
  const multiEnd = Math.max(...multi.map(r => r.end))
  const multiTokens = multi.reduce((a, r) => a + r.count, 0)
  // Fresh prompts per rep for the TTFTs: nothing cached to hit even if a cache were on.
  const short = await complete(s, promptIds(PROMPT, 100 + rep), 1)
  const long = await complete(s, promptIds(LONG, 200 + rep), 1)
  const rss = peakRss(s.child)
  const refusedTimed = refused.get(s) ?? 0
  // The same prompts again, untimed, for the ids: alone, then all streams at once (batched).
  const singleIds = verify ? await greedyIds(s, promptIds(PROMPT, 1), TOKENS) : []
  const multiIds = verify ? await Promise.all(Array.from({ length: STREAMS }, async (_, i) => await greedyIds(s, promptIds(PROMPT, 10 + i), TOKENS))) : []
  return {
    kind: s.kind,
    startMs: s.startMs,
    singleIds,
    singleTokens: single.count,
    singleDecode: (single.count - 1) / (((single.end - single.t0) - (short.end - short.t0)) / 1000),
    singleDecodeChunks: (single.count - 1) / ((single.last - single.first) / 1000),
    multiTokS: multiTokens / ((multiEnd - t) / 1000),
    multiTokens,
    multiIds,
    multiWallS: (multiEnd - t) / 1000,
    ttftShortMs: short.end - short.t0,
    ttftLongMs: long.end - long.t0,
    peakRss: rss,
    refusedTimed,
  }
}

// ---------------------------------------------------------------------------------------------
// llama-bench.

interface BenchRow { test: string, tokS: number, sd: number }

function llamaBench (bin: string, m: ModelFiles): BenchRow[] {
  const r = spawnSync(RT[0] ?? join(bin, 'llama-bench'), [...RT.slice(1), ...(RT.length > 0 ? [join(bin, 'llama-bench')] : []), '-m', m.gguf, '-p', String(PROMPT), '-n', String(TOKENS), '-t', String(THREADS), '-r', args['bench-reps'], ...kvArgs(m, true), '-o', 'json'], { encoding: 'utf8', maxBuffer: 64 << 20, env: llamaEnv() })
  if (r.status !== 0) throw new Error(`llama-bench failed (${r.status ?? r.signal}): ${r.stderr.slice(-2000)}`)
  const rows = JSON.parse(r.stdout) as Array<{ n_prompt: number, n_gen: number, avg_ts: number, stddev_ts: number }>
  return rows.map(x => ({ test: x.n_gen > 0 ? `tg${x.n_gen}` : `pp${x.n_prompt}`, tokS: x.avg_ts, sd: x.stddev_ts }))
}

// ---------------------------------------------------------------------------------------------
// Report.

const f0 = (x: number): string => Number.isFinite(x) ? x.toFixed(0) : '–'
const f1 = (x: number): string => Number.isFinite(x) ? x.toFixed(1) : '–'
const f2 = (x: number): string => Number.isFinite(x) ? x.toFixed(2) : '–'
const mb = (b: number): string => Number.isFinite(b) ? (b / 2 ** 20).toFixed(0) : '–'
const best = (xs: number[], hi: boolean): number => hi ? Math.max(...xs) : Math.min(...xs)

function sameIds (a: number[], b: number[]): string {
  const n = Math.min(a.length, b.length)
  const at = a.findIndex((x, i) => i < n && x !== b[i])
  if (at < 0) return a.length === b.length ? `identical (${n})` : `identical over ${n} (lengths ${a.length} / ${b.length})`
  return `differ at ${at} of ${n}`
}

interface ModelRun { m: ModelFiles, bench: BenchRow[], runs: SessionResult[] }

function report (rows: ModelRun[]): string {
  const out: string[] = []
  const label = (m: ModelFiles): string => `${m.size} ${m.quant === 'none' ? 'fp32 / F32' : 'int4 / Q4_0'}`
  out.push(`### Tokens (greedy, token-id prompts, max_tokens ${TOKENS}; shoal vs llama-server, non-streamed, first runs)`)
  out.push('')
  out.push(`| model | 1 stream, ${PROMPT}-tok prompt | ${STREAMS} streams (each vs its llama twin) |`)
  out.push('|---|---|---|')
  for (const r of rows) {
    const l = r.runs.find(x => x.kind === 'llama' && x.singleIds.length > 0)
    const s = r.runs.find(x => x.kind === 'shoal' && x.singleIds.length > 0)
    if (l === undefined || s === undefined) continue
    const multi = s.multiIds.map((ids, i) => sameIds(ids, l.multiIds[i]!))
    const same = multi.filter(x => x.startsWith('identical')).length
    out.push(`| ${label(r.m)} | ${sameIds(s.singleIds, l.singleIds)} | ${same}/${STREAMS} identical${same < STREAMS ? ` (${multi.join('; ')})` : ''} |`)
  }
  out.push('')
  out.push('### Every run')
  out.push('')
  out.push(`| model | server | start s | decode tok/s, 1 stream, end to end (tokens) | same, first to last chunk | ${STREAMS} streams tok/s (tokens, wall s) | TTFT ${PROMPT} ms | TTFT ${LONG} ms | peak RSS MB | 429s retried |`)
  out.push('|---|---|---:|---:|---:|---:|---:|---:|---:|---:|')
  for (const r of rows) {
    for (const x of r.runs) {
      out.push(`| ${label(r.m)} | ${x.kind === 'llama' ? 'llama-server' : 'shoal serve'} | ${f1(x.startMs / 1000)} | ${f1(x.singleDecode)} (${x.singleTokens}) | ${f1(x.singleDecodeChunks)} | ${f1(x.multiTokS)} (${x.multiTokens}, ${f1(x.multiWallS)}) | ${f1(x.ttftShortMs)} | ${f0(x.ttftLongMs)} | ${mb(x.peakRss)} | ${x.refusedTimed} |`)
    }
  }
  out.push('')
  out.push('### llama-bench (engine only, no server)')
  out.push('')
  out.push('| model | test | tok/s ± sd |')
  out.push('|---|---|---:|')
  for (const r of rows) for (const b of r.bench) out.push(`| ${label(r.m)} | ${b.test} | ${f1(b.tokS)} ± ${f1(b.sd)} |`)
  out.push('')
  out.push('### shoal / llama.cpp (best run of each side; > 1 means shoal is faster, or for TTFT and RSS: shoal / llama, < 1 is better)')
  out.push('')
  out.push(`| model | decode 1 stream: shoal / llama-server / llama-bench tg${TOKENS} tok/s | shoal÷server | shoal÷bench | ${STREAMS} streams: shoal / llama tok/s | shoal÷llama | TTFT ${PROMPT}: shoal / llama ms | shoal÷llama | TTFT ${LONG}: shoal / llama ms | shoal÷llama | llama-bench pp${PROMPT} tok/s | peak RSS MB shoal / llama | weights MB shoal / GGUF | RSS÷weights shoal / llama |`)
  out.push('|---|---|---:|---:|---|---:|---|---:|---|---:|---:|---|---|---|')
  for (const r of rows) {
    const S = r.runs.filter(x => x.kind === 'shoal')
    const L = r.runs.filter(x => x.kind === 'llama')
    if (S.length === 0 || L.length === 0) continue
    const sd = best(S.map(x => x.singleDecode), true)
    const ld = best(L.map(x => x.singleDecode), true)
    const tg = r.bench.find(b => b.test.startsWith('tg'))?.tokS ?? NaN
    const pp = r.bench.find(b => b.test.startsWith('pp'))?.tokS ?? NaN
    const sm = best(S.map(x => x.multiTokS), true)
    const lm = best(L.map(x => x.multiTokS), true)
    const ss = best(S.map(x => x.ttftShortMs), false)
    const ls = best(L.map(x => x.ttftShortMs), false)
    const sl = best(S.map(x => x.ttftLongMs), false)
    const ll = best(L.map(x => x.ttftLongMs), false)
    const sr = best(S.map(x => x.peakRss), true)
    const lr = best(L.map(x => x.peakRss), true)
    out.push(`| ${label(r.m)} | ${f1(sd)} / ${f1(ld)} / ${f1(tg)} | **${f2(sd / ld)}** | ${f2(sd / tg)} | ${f1(sm)} / ${f1(lm)} | **${f2(sm / lm)}** | ${f1(ss)} / ${f1(ls)} | ${f2(ss / ls)} | ${f0(sl)} / ${f0(ll)} | ${f2(sl / ll)} | ${f0(pp)} | ${mb(sr)} / ${mb(lr)} | ${mb(r.m.shoalWeightBytes)} / ${mb(r.m.ggufWeightBytes)} | ${f2(sr / r.m.shoalWeightBytes)} / ${f2(lr / r.m.ggufWeightBytes)} |`)
  }
  return out.join('\n')
}

// ---------------------------------------------------------------------------------------------

function lscpuModel (): string {
  const r = spawnSync('lscpu', [], { encoding: 'utf8' })
  return /Model name:\s*(.+)/.exec(r.stdout ?? '')?.[1]?.trim() ?? 'unknown CPU'
}

async function main (): Promise<void> {
  const began = Date.now()
  const sizes = args.sizes.split(',') as TestModelSize[]
  const quants = args.quants.split(',') as Array<'none' | 'int4'>
  const models: ModelFiles[] = []
  for (const size of sizes) for (const q of quants) models.push(await ensureModel(size, q))
  if (args['prepare-only'] === true) return
  const bin = await ensureLlamaCpp()
  const policy = spawnSync('chrt', ['-p', String(process.pid)], { encoding: 'utf8' }).stdout?.trim().replace(/\n/g, '; ') ?? '?'
  const loadStart = loadAverage(2)
  const cache = await mkdtemp(join(tmpdir(), 'shoal-vs-llamacpp-'))
  const rows: ModelRun[] = []
  const failures: string[] = []
  try {
    for (const m of models) {
      const t = performance.now()
      const run: ModelRun = { m, bench: [], runs: [] }
      rows.push(run)
      if (args['verify-only'] !== true) {
        try { run.bench = llamaBench(bin, m) } catch (err) { failures.push(`${m.modelId} llama-bench: ${(err as Error).message.slice(0, 300)}`) }
      }
      const reps = args['verify-only'] === true ? 1 : REPS
      for (let rep = 0; rep < reps; rep++) {
        // llama, shoal | shoal, llama | ...: each side goes first half the time.
        const order: Array<'llama' | 'shoal'> = rep % 2 === 0 ? ['llama', 'shoal'] : ['shoal', 'llama']
        for (const kind of order) {
          // A failed run is reported and skipped: the others still make the table.
          let s: Server | undefined
          try {
            s = kind === 'llama' ? await startLlama(bin, m) : await startShoal(m, cache)
            run.runs.push(await session(s, rep, rep === 0 && args['skip-ids'] !== true))
          } catch (err) {
            failures.push(`${m.modelId} rep ${rep + 1} ${kind}: ${(err as Error).message.slice(0, 300)}`)
            log(`FAILED: ${failures.at(-1)!}`)
            continue
          } finally {
            if (s !== undefined) await stop(s)
          }
          const x = run.runs.at(-1)!
          log(`${m.modelId} rep ${rep + 1}/${reps} ${kind}: decode ${f1(x.singleDecode)} tok/s, ${STREAMS} streams ${f1(x.multiTokS)} tok/s, TTFT ${f0(x.ttftShortMs)} / ${f0(x.ttftLongMs)} ms, RSS ${mb(x.peakRss)} MB`)
        }
      }
      log(`${m.modelId}: ${((performance.now() - t) / 1000).toFixed(0)} s`)
    }
  } finally {
    await rm(cache, { recursive: true, force: true })
  }
  const lines = [
    `command: node reproduction/bench-vs-llamacpp.ts ${process.argv.slice(2).join(' ')}`,
    `machine: ${lscpuModel()}, ${availableParallelism()} CPUs, ${(totalmem() / 2 ** 30).toFixed(0)} GiB; Node ${process.version}; scheduling of this process: ${policy}${RT.length > 0 ? `; servers and llama-bench under \`${RT.join(' ')}\`` : ''}`,
    `llama.cpp: ${gitDescribe(resolve(bin, '..', '..'))}${args['llama-lib'] !== undefined ? ` (ggml libraries from ${args['llama-lib']})` : ''}; llama-server ${llamaServerArgs('<gguf>', 0).join(' ')}; llama-bench -p ${PROMPT} -n ${TOKENS} -t ${THREADS} -r ${args['bench-reps']}; attention (server and bench): ${args['llama-kv'] === 'default' ? 'llama.cpp defaults (f16 KV cache, -fa auto)' : args['llama-kv'] === 'exact' ? '`-ctk f32 -ctv f32 -fa off` beside F32 (shoal\'s precision; llama-bench takes no f32 cache: `-fa off` alone), defaults beside Q4_0' : `-ctk/-ctv ${args['llama-kv']}`}`,
    `shoal: \`shoal serve --model <shards> --device cpu --kv-cache-mb 0${args['shoal-args'] === '' ? '' : ` ${args['shoal-args']}`}\` (shards compiled with --quant none / int4, default activations); git ${gitDescribe(REPO)}`,
    `requests: /v1/completions, token-id prompts, ${TEMPERATURE === 0 ? 'greedy (temperature 0)' : `sampled (temperature ${TEMPERATURE}, whole vocabulary: top_p 1; llama-server also top_k 0, min_p 0, typical_p 1)`}, streamed; ${PROMPT}-token prompt, max_tokens ${TOKENS}; ${STREAMS} concurrent streams; TTFT with max_tokens 1 on fresh ${PROMPT}- and ${LONG}-token prompts; ${REPS} reps per server, alternating`,
    `load average (1/5/15 min): at start ${loadStart}; at end ${loadAverage(2)}; total ${((Date.now() - began) / 1000).toFixed(0)} s`,
  ]
  for (const f of failures) lines.push(`FAILED: ${f}`)
  console.log(lines.map(l => `- ${l}`).join('\n'))
  console.log('')
  console.log(report(rows))
}

function gitDescribe (dir: string): string {
  const r = spawnSync('git', ['-C', dir, 'log', '-1', '--format=%h %s'], { encoding: 'utf8' })
  return r.status === 0 ? r.stdout.trim().slice(0, 100) : '?'
}

await main()
