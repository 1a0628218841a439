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
 *     [--quants none,int4] [--reps 2] [--tokens 128] [--streams 8] [--long 2000 (0: none)] [--verify-only]
 *     [--llama-kv default|exact|f16|f32]   (see kvArgs; check fp32 tokens with --verify-only --llama-kv exact)
 *     [--prepare-only]   (generate, compile and write the models, nothing else)
 *     [--skip-ids]       (no untimed pass for the greedy ids: timing only)
 *     [--warmup 128]     (decode tokens of the untimed warm-up requests shaped like the timed ones — one stream, then
 *                         --streams at once; 0: time the first requests after start)
 *     [--temperature T]  (timed requests sample at T over the whole vocabulary; default 0, greedy)
 * Models, shards and GGUF files are made once under .cache/bench-vs-llamacpp/ and reused.
 */
import { mkdtemp, rm } from 'node:fs/promises'
import { availableParallelism, tmpdir, totalmem } from 'node:os'
import { join, resolve } from 'node:path'
import { performance } from 'node:perf_hooks'
import { parseArgs } from 'node:util'
import { gitDescribe, loadAverage, lscpuModel, promptIds } from './lib/index.ts'
import { ensureModels } from './lib/bench-models.ts'
import type { ModelFiles } from './lib/bench-models.ts'
import { complete, greedyIds, refusedCount } from './lib/completions.ts'
import { ensureLlamaCpp, kvArgs, llamaBench, llamaEnv, llamaServerArgs } from './lib/llamacpp.ts'
import type { BenchRow, LlamaShape } from './lib/llamacpp.ts'
import { rtPrefix, schedulingPolicy } from './lib/realtime.ts'
import { peakRss, startLlama, startShoal, stop } from './lib/servers.ts'
import type { Server } from './lib/servers.ts'

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
    // Decode tokens of the untimed steady-state warm-up request (a PROMPT-token prompt) per server run; 0: none.
    warmup: { type: 'string', default: '128' },
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
const WARMUP = Number(args.warmup)
const THREADS = Number(args.threads)
const REPO = resolve(import.meta.dirname, '..')

/** What llama-server and llama-bench are sized for: this run's threads, streams and prompt lengths. */
const SHAPE: LlamaShape = { threads: THREADS, streams: STREAMS, prompt: PROMPT, tokens: TOKENS, long: LONG }

const log = (s: string): void => { process.stderr.write(`${s}\n`) }

// ---------------------------------------------------------------------------------------------
// One server run: the timed requests, then (first rep) the untimed ones for the ids.

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
  await complete(s, promptIds(16, 999), 8, TEMPERATURE) // warm-up: first session run, JIT, thread pools
  // Then one untimed request shaped like the timed one: a server just started runs its first few
  // hundred steps slower (shoal's 60m int4 bare session.run: 20–30 % over its first 160 steps after
  // 20 warm-up runs, 2–8 % after 300 — docs/engine-notes.md), and one stream is timed in steady state
  // on both sides, as llama-bench times its own runs after a warm-up. `--warmup 0`: the first
  // request after start.
  if (WARMUP > 0) await complete(s, promptIds(PROMPT, 998), WARMUP, TEMPERATURE)
  const single = await complete(s, promptIds(PROMPT, 1), TOKENS, TEMPERATURE)
  // Likewise the concurrent streams after an untimed round shaped like them: shoal's first
  // eight-stream burst after start ran 10–35 % slower than later ones (60m int4: 548–692 vs 771–1,042
  // tok/s; docs/engine-notes.md, wave 9), and llama-server's eight streams gained from it too.
  if (WARMUP > 0) await Promise.all(Array.from({ length: STREAMS }, async (_, i) => await complete(s, promptIds(PROMPT, 980 + i), WARMUP, TEMPERATURE)))
  const t = performance.now()
  const multi = await Promise.all(Array.from({ length: STREAMS }, async (_, i) => await complete(s, promptIds(PROMPT, 10 + i), TOKENS, TEMPERATURE)))
  const multiEnd = Math.max(...multi.map(r => r.end))
  const multiTokens = multi.reduce((a, r) => a + r.count, 0)
  // Fresh prompts per rep for the TTFTs: nothing cached to hit even if a cache were on.
  const short = await complete(s, promptIds(PROMPT, 100 + rep), 1, TEMPERATURE)
  // --long 0: no long-prompt TTFT (an empty prompt is refused by both servers).
  const long = LONG > 0 ? await complete(s, promptIds(LONG, 200 + rep), 1, TEMPERATURE) : undefined
  const rss = peakRss(s.child)
  const refusedTimed = refusedCount(s)
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
    ttftLongMs: long === undefined ? NaN : long.end - long.t0,
    peakRss: rss,
    refusedTimed,
  }
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

async function main (): Promise<void> {
  const began = Date.now()
  const models = await ensureModels(args.sizes, args.quants, log)
  if (args['prepare-only'] === true) return
  const bin = await ensureLlamaCpp(args['llama-dir'])
  const policy = schedulingPolicy()
  const rt = rtPrefix()
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
        try { run.bench = llamaBench(bin, m.gguf, SHAPE, args['bench-reps'], kvArgs(args['llama-kv'], m.quant, true), llamaEnv(args['llama-lib'])) } catch (err) { failures.push(`${m.modelId} llama-bench: ${(err as Error).message.slice(0, 300)}`) }
      }
      const reps = args['verify-only'] === true ? 1 : REPS
      for (let rep = 0; rep < reps; rep++) {
        // llama, shoal | shoal, llama | ...: each side goes first half the time.
        const order: Array<'llama' | 'shoal'> = rep % 2 === 0 ? ['llama', 'shoal'] : ['shoal', 'llama']
        for (const kind of order) {
          // A failed run is reported and skipped: the others still make the table.
          let s: Server | undefined
          try {
            s = kind === 'llama'
              ? await startLlama(bin, m.modelId, port => [...llamaServerArgs(m.gguf, port, SHAPE), ...kvArgs(args['llama-kv'], m.quant)], llamaEnv(args['llama-lib']))
              : await startShoal(m.shards, m.modelId, cache, args['shoal-args'].split(' ').filter(a => a.length > 0))
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
    `machine: ${lscpuModel()}, ${availableParallelism()} CPUs, ${(totalmem() / 2 ** 30).toFixed(0)} GiB; Node ${process.version}; scheduling of this process: ${policy}${rt.length > 0 ? `; servers and llama-bench under \`${rt.join(' ')}\`` : ''}`,
    `llama.cpp: ${gitDescribe(resolve(bin, '..', '..'))}${args['llama-lib'] !== undefined ? ` (ggml libraries from ${args['llama-lib']})` : ''}; llama-server ${llamaServerArgs('<gguf>', 0, SHAPE).join(' ')}; llama-bench -p ${PROMPT} -n ${TOKENS} -t ${THREADS} -r ${args['bench-reps']}; attention (server and bench): ${args['llama-kv'] === 'default' ? 'llama.cpp defaults (f16 KV cache, -fa auto)' : args['llama-kv'] === 'exact' ? '`-ctk f32 -ctv f32 -fa off` beside F32 (shoal\'s precision; llama-bench takes no f32 cache: `-fa off` alone), defaults beside Q4_0' : `-ctk/-ctv ${args['llama-kv']}`}`,
    `shoal: \`shoal serve --model <shards> --device cpu --kv-cache-mb 0${args['shoal-args'] === '' ? '' : ` ${args['shoal-args']}`}\` (shards compiled with --quant none / int4, default activations); git ${gitDescribe(REPO)}`,
    `requests: /v1/completions, token-id prompts, ${TEMPERATURE === 0 ? 'greedy (temperature 0)' : `sampled (temperature ${TEMPERATURE}, whole vocabulary: top_p 1; llama-server also top_k 0, min_p 0, typical_p 1)`}, streamed; ${PROMPT}-token prompt, max_tokens ${TOKENS}, ${WARMUP > 0 ? `after an untimed warm-up request of the same prompt length and ${WARMUP} tokens` : 'the first long request after start'}; ${STREAMS} concurrent streams${WARMUP > 0 ? ` (after an untimed round of ${STREAMS} such warm-up requests)` : ''}; TTFT with max_tokens 1 on fresh ${PROMPT}- and ${LONG}-token prompts; ${REPS} reps per server, alternating`,
    `load average (1/5/15 min): at start ${loadStart}; at end ${loadAverage(2)}; total ${((Date.now() - began) / 1000).toFixed(0)} s`,
  ]
  for (const f of failures) lines.push(`FAILED: ${f}`)
  console.log(lines.map(l => `- ${l}`).join('\n'))
  console.log('')
  console.log(report(rows))
}

await main()
