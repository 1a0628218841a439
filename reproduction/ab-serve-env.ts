/**
 * `shoal serve` under two (or more) process environments, side by side: each arm starts its own
 * server with its variables set, the arms alternate (A B, B A, …) so a drifting machine hits them
 * alike, and the same client times eight concurrent streams and one stream on each. Made for the
 * launcher's glibc malloc tunables (docs/engine-notes.md, wave 9): "without" is any GLIBC_TUNABLES
 * that sets a malloc key (scripts/malloc.mjs then leaves the environment as it is).
 *
 *   node reproduction/ab-serve-env.ts --shard DIR [--reps 4] [--streams 8] [--tokens 128] [--long 0]
 *     [--arms '{"with":{},"without":{"GLIBC_TUNABLES":"glibc.malloc.check=0"}}']
 *
 * An arm is its environment's variables, or `{"env": {…}, "dir": CHECKOUT, "shard": DIR, "args": [...]}`:
 * the server of another checkout (a `git worktree` of the base commit), on a shard of its own (one
 * its compiler built, when the change is the graph's), with arguments added to `shoal serve`.
 *
 * Per server: an untimed round of STREAMS requests (64 tokens) and one of a single stream (the
 * first steps after start are slower: wave 8/9), then two timed rounds, each STREAMS streams at once
 * (aggregate tok/s, request sent to last response ended) and one stream (first to last token).
 * `--long N`: then one N-token prompt (max_tokens 1), untimed, before the peak RSS is read.
 * Prints every round and each server's peak RSS (VmHWM), each arm's medians and ranges, in how
 * many reps each arm beat the first, the command, the machine and the load.
 */
import { performance } from 'node:perf_hooks'
import { parseArgs } from 'node:util'
import { complete } from './lib/completions.ts'
import { gitDescribe, loadAverage, lscpuModel, mean, median, promptIds } from './lib/index.ts'
import { peakRss, shoalArm, startShoalArm, stop } from './lib/servers.ts'
import type { ShoalArm } from './lib/servers.ts'
import { loadManifest } from '../shards/index.ts'

const { values: args } = parseArgs({
  options: {
    shard: { type: 'string' },
    reps: { type: 'string', default: '4' },
    streams: { type: 'string', default: '8' },
    tokens: { type: 'string', default: '128' },
    long: { type: 'string', default: '0' },
    arms: { type: 'string', default: JSON.stringify({ with: {}, without: { GLIBC_TUNABLES: 'glibc.malloc.check=0' } }) },
    cache: { type: 'string', default: '/tmp/shoal-ab-serve-env' },
  },
})
if (args.shard === undefined) throw new Error('--shard DIR is needed (a compiled shard directory)')
const shard = args.shard
const REPS = Number(args.reps)
const STREAMS = Number(args.streams)
const TOKENS = Number(args.tokens)
/** Timed rounds per server (each: STREAMS streams, then one). */
const ROUNDS = 2
const LONG = Number(args.long)
const given = JSON.parse(args.arms) as Record<string, Record<string, string> | ShoalArm>
const arms: Record<string, ShoalArm> = Object.fromEntries(Object.entries(given).map(([k, a]) => [k, shoalArm(a)]))
const names = Object.keys(arms)
if (names.length < 2) throw new Error('--arms needs at least two arms')

const manifest = await loadManifest(shard)
const results = new Map(names.map(n => [n, { streams: [] as number[], one: [] as number[], rss: [] as number[] }]))
const loadStart = loadAverage(2)

for (let rep = 0; rep < REPS; rep++) {
  for (const name of rep % 2 === 0 ? names : [...names].reverse()) {
    const arm = arms[name]!
    const server = await startShoalArm(arm, shard, manifest.modelId, args.cache)
    const ep = { kind: 'shoal' as const, url: server.url, model: manifest.modelId }
    try {
      await Promise.all(Array.from({ length: STREAMS }, async (_, i) => await complete(ep, promptIds(128, 900 + i), 64, 0)))
      await complete(ep, promptIds(128, 999), TOKENS, 0)
      const r = results.get(name)!
      for (let round = 0; round < ROUNDS; round++) {
        const t0 = performance.now()
        const many = await Promise.all(Array.from({ length: STREAMS }, async (_, i) => await complete(ep, promptIds(128, rep * 100 + round * 10 + i), TOKENS, 0)))
        const end = Math.max(...many.map(c => c.end))
        r.streams.push(many.reduce((a, c) => a + c.count, 0) / ((end - t0) / 1000))
        const one = await complete(ep, promptIds(128, rep * 100 + round * 10 + 9), TOKENS, 0)
        r.one.push((one.count - 1) / ((one.last - one.first) / 1000))
      }
      // A long prompt last (max_tokens 1), as bench-vs-llamacpp's TTFT: the peak RSS it reaches.
      if (LONG > 0) await complete(ep, promptIds(LONG, rep * 100 + 50), 1, 0)
      r.rss.push(peakRss(server.child))
      console.log(`rep ${rep + 1} ${name}: ${STREAMS} streams ${r.streams.slice(-ROUNDS).map(x => x.toFixed(0)).join(' / ')} tok/s, one stream ${r.one.slice(-ROUNDS).map(x => x.toFixed(0)).join(' / ')} tok/s, peak RSS ${(r.rss.at(-1)! / 2 ** 20).toFixed(0)} MB`)
    } finally {
      await stop(server)
    }
  }
}

console.log('')
console.log(`- command: node reproduction/ab-serve-env.ts ${process.argv.slice(2).join(' ')}`)
console.log(`- machine: ${lscpuModel()}; Node ${process.version}; git ${gitDescribe(process.cwd())}`)
console.log(`- load average (1/5/15 min): at start ${loadStart}; at end ${loadAverage(2)}`)
console.log('')
// On a VM whose speed drifts ±20–40 % a median alone misleads (docs/engine-notes.md, wave 10):
// each arm's range, and in how many reps it beat the first arm (each rep's rounds averaged;
// the arms of a rep ran back to back).
const first = names[0]!
const range = (xs: number[]): string => `${Math.min(...xs).toFixed(0)}–${Math.max(...xs).toFixed(0)}`
const wins = (mine: number[], theirs: number[]): string => {
  let n = 0
  for (let rep = 0; rep < REPS; rep++) if (mean(mine.slice(ROUNDS * rep, ROUNDS * (rep + 1))) > mean(theirs.slice(ROUNDS * rep, ROUNDS * (rep + 1)))) n++
  return `${n}/${REPS}`
}
console.log(`| arm | environment, checkout, shard | ${STREAMS} streams tok/s, median of ${REPS * ROUNDS} (range) | reps ahead of ${first} | one stream tok/s, median (range) | reps ahead of ${first} | peak RSS MB, median of ${REPS} |`)
console.log('|---|---|---:|---:|---:|---:|---:|')
for (const name of names) {
  const r = results.get(name)!
  const f = results.get(first)!
  const ahead = (mine: number[], theirs: number[]): string => name === first ? '—' : wins(mine, theirs)
  console.log(`| ${name} | ${JSON.stringify(arms[name])} | ${median(r.streams).toFixed(0)} (${range(r.streams)}) | ${ahead(r.streams, f.streams)} | ${median(r.one).toFixed(0)} (${range(r.one)}) | ${ahead(r.one, f.one)} | ${(median(r.rss) / 2 ** 20).toFixed(0)} |`)
}
