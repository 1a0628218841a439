/**
 * A fresh server's first requests, shoal beside llama-server: what a user who starts a server and
 * asks it at once sees. paired-vs-llamacpp.ts warms both servers before it measures; this starts
 * each server anew every round and times its start (spawn to the API answering: the process, the
 * model's load and any warm-up) and then its first --requests TTFTs (a fresh --prompt-token
 * prompt each, max_tokens 1, no prompt cache on either side) and one decode of --tokens tokens.
 * Rounds alternate which server goes first; one server runs at a time. --idle waits that long
 * after a server answers before its first request: a user who starts a server and asks later.
 *
 * This process's own first requests are slow too (its fetch and SSE code compiling: ~30 ms of
 * client CPU landed in a fresh server's second request), so before the rounds it asks one server
 * of each kind a few untimed requests.
 *
 *   node reproduction/cold-start.ts [--sizes 60m] [--quants int4] [--rounds 6] [--requests 3]
 *     [--prompt 128] [--tokens 128] [--idle 0] [--llama-dir DIR] [--arms '{"llama-server":"llama","shoal":{}}']
 * Run it as paired-vs-llamacpp.ts is run (`chrt -r 10 node …`, nothing else on the machine).
 * `--arms` as there (lib/arms.ts): two shoal checkouts compare a change to the start.
 */
import { mkdtemp, rm } from 'node:fs/promises'
import { availableParallelism, tmpdir, totalmem } from 'node:os'
import { join, resolve } from 'node:path'
import { parseArgs } from 'node:util'
import { isLlama, parseArms, startArm } from './lib/arms.ts'
import { ensureModels } from './lib/bench-models.ts'
import type { ModelFiles } from './lib/bench-models.ts'
import { complete } from './lib/completions.ts'
import { gitDescribe, loadAverage, lscpuModel, median, medianInterval, promptIds } from './lib/index.ts'
import { ensureLlamaCpp, llamaServerArgs } from './lib/llamacpp.ts'
import { rtPrefix, schedulingPolicy } from './lib/realtime.ts'
import { stop } from './lib/servers.ts'

const { values: args } = parseArgs({
  options: {
    'llama-dir': { type: 'string' },
    sizes: { type: 'string', default: '60m' },
    quants: { type: 'string', default: 'int4' },
    rounds: { type: 'string', default: '6' },
    requests: { type: 'string', default: '3' },
    prompt: { type: 'string', default: '128' },
    tokens: { type: 'string', default: '128' },
    // A user who starts a server and asks it a little later: ms after it answers before the first request.
    idle: { type: 'string', default: '0' },
    threads: { type: 'string', default: String(availableParallelism()) },
    arms: { type: 'string', default: '{"llama-server":"llama","shoal":{}}' },
  },
})
const ARMS = parseArms(args.arms)
const ROUNDS = Number(args.rounds)
const REQUESTS = Number(args.requests)
const PROMPT = Number(args.prompt)
const TOKENS = Number(args.tokens)
const IDLE = Number(args.idle)
// llama-server as paired-vs-llamacpp.ts starts it (its default eight slots), so the figures compare.
const SHAPE = { threads: Number(args.threads), streams: 8, prompt: PROMPT, tokens: TOKENS, long: 0 }
const REPO = resolve(import.meta.dirname, '..')
const log = (s: string): void => { process.stderr.write(`${s}\n`) }

/** One fresh server's figures: its start, its first REQUESTS TTFTs, one decode. */
interface Fresh { startMs: number, ttft: number[], decode: number }

async function fresh (arm: (typeof ARMS)[number][1], m: ModelFiles, bin: string, cache: string, salt: number): Promise<Fresh> {
  const s = await startArm(arm, m, bin, SHAPE, cache)
  try {
    if (IDLE > 0) await new Promise(resolve => setTimeout(resolve, IDLE))
    const ttft: number[] = []
    for (let i = 0; i < REQUESTS; i++) {
      const c = await complete(s, promptIds(PROMPT, salt + i), 1, 0)
      ttft.push(c.end - c.t0)
    }
    const d = await complete(s, promptIds(PROMPT, salt + 500), TOKENS, 0)
    return { startMs: s.startMs, ttft, decode: (d.count - 1) / ((d.last - d.first) / 1000) }
  } finally {
    await stop(s)
  }
}

const f = (x: number, digits = 1): string => Number.isFinite(x) ? x.toFixed(digits) : '–'

async function main (): Promise<void> {
  const began = Date.now()
  const models = await ensureModels(args.sizes, args.quants, log)
  const bin = ARMS.some(([, arm]) => isLlama(arm)) ? await ensureLlamaCpp(args['llama-dir']) : ''
  const loadStart = loadAverage(2)
  const cache = await mkdtemp(join(tmpdir(), 'shoal-cold-'))
  const rows: string[] = []
  try {
    for (const m of models) {
      // Untimed: this process's request code, for both dialects.
      for (const [name, arm] of ARMS) {
        const s = await startArm(arm, m, bin, SHAPE, join(cache, `${name}-client`))
        try { for (let i = 0; i < 4; i++) await complete(s, promptIds(PROMPT, 900 + i), i % 2 === 0 ? 1 : 16, 0) } finally { await stop(s) }
      }
      const runs: Fresh[][] = ARMS.map(() => [])
      for (let r = 0; r < ROUNDS; r++) {
        const order = r % 2 === 0 ? [0, 1] : [1, 0]
        for (const k of order) {
          const [name, arm] = ARMS[k]!
          const x = await fresh(arm, m, bin, join(cache, `${name}-${r}`), 1000 + r * 100)
          runs[k]!.push(x)
          log(`${m.modelId} round ${r + 1} ${name}: start ${f(x.startMs, 0)} ms, TTFT ${x.ttft.map(t => f(t)).join(' / ')} ms, decode ${f(x.decode, 0)} tok/s`)
        }
      }
      const [a, b] = runs as [Fresh[], Fresh[]]
      const ratio = (g: (x: Fresh) => number): string => {
        const rs = b.map((x, i) => g(x) / g(a[i]!))
        const [lo, hi] = medianInterval(rs)
        return `**${f(median(rs), 3)}** (${f(lo, 3)}–${f(hi, 3)})`
      }
      const side = (xs: Fresh[], g: (x: Fresh) => number, digits = 1): string => f(median(xs.map(g)), digits)
      const later = (x: Fresh): number => median(x.ttft.slice(1))
      rows.push(`| ${m.modelId} | start (ms) | ${side(a, x => x.startMs, 0)} | ${side(b, x => x.startMs, 0)} | ${ratio(x => x.startMs)} |`)
      rows.push(`| ${m.modelId} | first request's TTFT ${PROMPT} (ms) | ${side(a, x => x.ttft[0]!)} | ${side(b, x => x.ttft[0]!)} | ${ratio(x => x.ttft[0]!)} |`)
      if (REQUESTS > 1) rows.push(`| ${m.modelId} | requests 2–${REQUESTS}: TTFT ${PROMPT} (ms) | ${side(a, later)} | ${side(b, later)} | ${ratio(later)} |`)
      rows.push(`| ${m.modelId} | then decode, 1 stream (tok/s) | ${side(a, x => x.decode, 0)} | ${side(b, x => x.decode, 0)} | ${ratio(x => x.decode)} |`)
    }
  } finally {
    await rm(cache, { recursive: true, force: true })
  }
  const rt = rtPrefix()
  console.log([
    `command: node reproduction/cold-start.ts ${process.argv.slice(2).join(' ')}`,
    `machine: ${lscpuModel()}, ${availableParallelism()} CPUs, ${(totalmem() / 2 ** 30).toFixed(0)} GiB; Node ${process.version}; scheduling of this process: ${schedulingPolicy()}${rt.length > 0 ? `; servers under \`${rt.join(' ')}\`` : ''}`,
    `arms: ${ARMS.map(([name, arm]) => `${name} = ${JSON.stringify(arm)}`).join('; ')} (ratios: ${ARMS[1]![0]} ÷ ${ARMS[0]![0]}, per round)`,
    ...(bin === '' ? [] : [`llama.cpp: ${gitDescribe(resolve(bin, '..', '..'))}; llama-server ${llamaServerArgs('<gguf>', 0, SHAPE).join(' ')}`]),
    `shoal: \`shoal serve --model <shards> --device cpu --kv-cache-mb 0\`; git ${gitDescribe(REPO)}`,
    `${ROUNDS} rounds, each server started fresh in each, order alternating; ${IDLE > 0 ? `idle ${IDLE} ms after it answers, then ` : ''}${REQUESTS} requests of a fresh ${PROMPT}-token prompt (max_tokens 1), then one of ${TOKENS} tokens`,
    `load average (1/5/15 min): at start ${loadStart}; at end ${loadAverage(2)}; total ${((Date.now() - began) / 1000).toFixed(0)} s`,
  ].map(l => `- ${l}`).join('\n'))
  console.log('')
  const [[ref], [other]] = ARMS as [[string, unknown], [string, unknown]]
  console.log(`| model | metric | ${ref} median | ${other} median | median of ${other} ÷ ${ref} (95 % interval) |`)
  console.log('|---|---|---:|---:|---:|')
  for (const r of rows) console.log(r)
}

await main()
