/**
 * Sampled decoding (temperature > 0, the OpenAI default of 1) against greedy, this tree against an
 * older checkout (`--base DIR`, e.g. a worktree of the commit before a sampler change):
 *  1. the sampler alone: `pickToken` on one 32k-vocabulary row of logits, per call, both trees'
 *     daemon/engine/sampling.ts imported into this one process, calls alternating;
 *  2. end to end: `shoal serve` from each tree on the same shard (one child process each, both
 *     loaded at once, prefix cache off), one streamed completion at a time, reps alternating
 *     (base, this, this, base, ...), decode tok/s of one stream (first to last token) greedy, at
 *     temperature 1 / top_p 1, and at temperature 0.7 / top_p 0.9.
 * Tokens are counted, not compared (the two samplers walk the kept tokens in different orders, so
 * a seed gives other tokens; both are exact draws from the same distribution).
 *
 * Run: chrt -r 10 node reproduction/bench-sampling.ts --shard .cache/bench/llama-60m-int4 --base /tmp/base
 *        [--reps 4] [--tokens 128] [--prompt 128]
 */
import { spawn } from 'node:child_process'
import type { ChildProcess } from 'node:child_process'
import { mkdtemp, rm } from 'node:fs/promises'
import { cpus, tmpdir } from 'node:os'
import { join, resolve } from 'node:path'
import { performance } from 'node:perf_hooks'
import { createInterface } from 'node:readline'
import { parseArgs } from 'node:util'
import { pickToken } from '../daemon/engine/sampling.ts'
import type { TokenPick } from '../daemon/engine/sampling.ts'
import { loadManifest } from '../shards/index.ts'
import { loadAverage, lowerMedian, promptIds, tokenChunks } from './lib/index.ts'

const { values: args } = parseArgs({ options: {
  shard: { type: 'string' }, base: { type: 'string' }, reps: { type: 'string', default: '4' },
  tokens: { type: 'string', default: '128' }, prompt: { type: 'string', default: '128' },
} })
if (args.shard === undefined || args.base === undefined) throw new Error('--shard DIR and --base DIR (an older checkout) are needed')
const shard = resolve(args.shard)
const base = resolve(args.base)
const REPS = Number(args.reps)
const TOKENS = Number(args.tokens)
const PROMPT = Number(args.prompt)
const MODES = [
  { name: 'greedy', temperature: 0, top_p: 1 },
  { name: 'T 1, top-p 1', temperature: 1, top_p: 1 },
  { name: 'T 0.7, top-p 0.9', temperature: 0.7, top_p: 0.9 },
] as const

console.log(`# bench-sampling ${new Date().toISOString()}\n# ${cpus()[0]?.model ?? 'cpu'} × ${cpus().length}, Node ${process.version}, load ${loadAverage()}\n# shard ${shard}, base ${base}`)

// 1. The sampler alone.
const { pickToken: basePick } = await import(join(base, 'daemon/engine/sampling.ts')) as { pickToken: typeof pickToken }
const manifest = await loadManifest(shard)
const vocab = manifest.shape.vocabSize
let seed = 7
const row = Float32Array.from({ length: vocab }, () => { seed = (seed * 1103515245 + 12345) >>> 0; return (seed / 2 ** 32) * 8 - 4 })
console.log(`\n## pickToken on one ${vocab}-token row (µs per call, median of 9 × 50 calls)\n\n| params | base | this | base ÷ this |\n|---|---:|---:|---:|`)
for (const m of MODES) {
  const time = (pick: typeof pickToken): number => {
    const t0 = performance.now()
    for (let i = 0; i < 50; i++) pick(row, { temperature: m.temperature, topP: m.top_p, u: (i * 0.37) % 1 } satisfies TokenPick)
    return (performance.now() - t0) / 50 * 1000
  }
  const a: number[] = []
  const b: number[] = []
  for (let r = 0; r < 9; r++) { a.push(time(basePick)); b.push(time(pickToken)) }
  const [ta, tb] = [lowerMedian(a), lowerMedian(b)]
  console.log(`| ${m.name} | ${ta.toFixed(1)} | ${tb.toFixed(1)} | ${(ta / tb).toFixed(1)} |`)
}

// 2. End to end.
interface Server { tree: 'base' | 'this', url: string, child: ChildProcess }
async function serve (tree: Server['tree'], root: string): Promise<Server> {
  const cache = await mkdtemp(join(tmpdir(), 'shoal-bench-sampling-'))
  const child = spawn(process.execPath, [join(root, 'scripts', 'shoal.mjs'), 'serve', '--model', shard, '--api', '127.0.0.1:0', '--device', 'cpu', '--kv-cache-mb', '0'],
    { stdio: ['ignore', 'pipe', 'inherit'], env: { ...process.env, SHOAL_CACHE: cache } })
  child.once('exit', () => { void rm(cache, { recursive: true, force: true }) })
  const url = await new Promise<string>((resolve, reject) => {
    const timer = setTimeout(() => { reject(new Error(`${tree}: shoal serve did not start within 300 s`)) }, 300_000)
    createInterface({ input: child.stdout! }).on('line', line => {
      const match = /^shoal: serving \S+ at (\S+)\/v1/.exec(line)
      if (match !== null) { clearTimeout(timer); resolve(match[1]!) }
    })
  })
  return { tree, url, child }
}

/** One streamed completion: decode tok/s from the first token to the last, and the tokens. */
async function decode (s: Server, mode: typeof MODES[number], salt: number): Promise<{ tokS: number, tokens: number }> {
  const res = await fetch(`${s.url}/v1/completions`, {
    method: 'POST', headers: { 'content-type': 'application/json' },
    body: JSON.stringify({ model: manifest.modelId, prompt: promptIds(PROMPT, salt), max_tokens: TOKENS, temperature: mode.temperature, top_p: mode.top_p, seed: salt, stream: true, return_token_ids: true }),
  })
  if (res.status !== 200) throw new Error(`${s.tree}: HTTP ${res.status}: ${await res.text()}`)
  let tokens = 0
  let first = NaN
  let last = NaN
  for await (const { ids, at } of tokenChunks(res.body, s.tree)) {
    if (Number.isNaN(first)) first = at
    last = at
    tokens += ids.length
  }
  return { tokS: (tokens - 1) / (last - first) * 1000, tokens }
}

const servers = [await serve('base', base), await serve('this', resolve(import.meta.dirname, '..'))]
try {
  for (const s of servers) await decode(s, MODES[1], 999) // warm-up
  const got = new Map<string, number[]>()
  for (let r = 0; r < REPS; r++) {
    const order = r % 2 === 0 ? servers : [...servers].reverse()
    for (const s of order) {
      for (const m of MODES) {
        const { tokS, tokens } = await decode(s, m, 10 + r)
        if (tokens < 2) continue
        const key = `${s.tree}|${m.name}`
        got.set(key, [...(got.get(key) ?? []), tokS])
      }
    }
  }
  console.log(`\n## Decode through HTTP, one stream (${PROMPT}-token prompt, ${TOKENS} tokens, tok/s first to last token: median (range) of ${REPS} reps)\n\n| mode | base | this | this ÷ base |\n|---|---:|---:|---:|`)
  for (const m of MODES) {
    const a = got.get(`base|${m.name}`) ?? []
    const b = got.get(`this|${m.name}`) ?? []
    const fmt = (x: number[]): string => `${lowerMedian(x).toFixed(0)} (${Math.min(...x).toFixed(0)}–${Math.max(...x).toFixed(0)})`
    console.log(`| ${m.name} | ${fmt(a)} | ${fmt(b)} | ${(lowerMedian(b) / lowerMedian(a)).toFixed(2)} |`)
  }
  console.log(`\n# load after ${loadAverage()}`)
} finally {
  for (const s of servers) s.child.kill('SIGTERM')
}
