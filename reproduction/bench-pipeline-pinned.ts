/**
 * Pipeline chain benchmark on real daemons, each stage pinned to its own core (issue 6), side by
 * side in one run: the unsplit model served by `shoal serve` on core 0, one stream (baseline);
 * a 2-stage chain of `shoal node` child processes (stage 0 on core 0, stage 1 on core 1, QUIC on
 * loopback, CA-issued identities), one stream (naive pipeline) and 2 / 4 concurrent streams
 * (interleaved). Clients stream greedy completions over HTTP (`return_token_ids`, so tokens are
 * counted exactly) from this process, which is not pinned. Only one configuration generates load
 * at a time, so the idle baseline server on core 0 does not disturb the chain.
 *
 * Reported per configuration: decode tok/s over the whole configuration (all streams' tokens /
 * wall time from the first request to the last token), median of `--rounds` rounds (each round
 * runs every configuration once, so drift in machine load hits all alike) and each round's value,
 * ratios to the unsplit baseline and to the naive chain, and per-stream ms/token (first token to
 * last). The chain's greedy token ids are checked against the unsplit server's (first round).
 *
 * `--f32-activations` compiles the quantized shards for f32 activations (slower per step, batched
 * with any mix of context lengths) instead of the default int8 ones (batched only between equally
 * long contexts), see shards/DESIGN.md.
 *
 *   node reproduction/bench-pipeline-pinned.ts [--quant int4] [--f32-activations] [--tokens 64] [--streams 1,2,4] [--rounds 3]
 */
import { spawnSync } from 'node:child_process'
import { mkdtemp, rm } from 'node:fs/promises'
import { availableParallelism, loadavg, tmpdir } from 'node:os'
import { join } from 'node:path'
import { performance } from 'node:perf_hooks'
import { setTimeout as sleep } from 'node:timers/promises'
import { parseArgs } from 'node:util'
import { createThrowawayCa } from '../certs/index.ts'
import { compileShards, generateTestModel } from '../shards/index.ts'
import { tokenChunks } from './sse.ts'
import { createShoalProcesses, formatLoad, streamPromptIds, upperMedianBy } from './lib/index.ts'

const { values: args } = parseArgs({
  options: {
    quant: { type: 'string', default: 'int4' },
    tokens: { type: 'string', default: '64' },
    streams: { type: 'string', default: '1,2,4' },
    rounds: { type: 'string', default: '3' },
    'f32-activations': { type: 'boolean', default: false },
  },
})
const QUANT = args.quant as 'none' | 'int4'
const ACTIVATIONS = args['f32-activations'] === true ? { accuracyLevel: 0 as const } : {}
const TOKENS = Number(args.tokens)
const STREAMS = args.streams.split(',').map(Number)
const ROUNDS = Number(args.rounds)
const PROMPT = 16
const MODEL = 'bench-pinned'
/** Child daemons, each optionally under `taskset -c CORE`. */
const daemons = createShoalProcesses()

// ---------------------------------------------------------------------------------------------
// Clients: streaming completions, timing each token as its chunk arrives.

interface StreamResult { ids: number[], t0: number, first: number, last: number }

async function streamCompletion (url: string, prompt: number[]): Promise<StreamResult> {
  const t0 = performance.now()
  const res = await fetch(`${url}/v1/completions`, {
    method: 'POST',
    headers: { 'content-type': 'application/json' },
    body: JSON.stringify({ model: MODEL, prompt, max_tokens: TOKENS, temperature: 0, stream: true, return_token_ids: true }),
    signal: AbortSignal.timeout(600_000),
  })
  if (res.status !== 200) throw new Error(`HTTP ${res.status} from ${url}: ${await res.text()}`)
  const ids: number[] = []
  let first = NaN
  let last = NaN
  for await (const { ids: got, at } of tokenChunks(res.body, url)) {
    if (ids.length === 0) first = at
    last = at
    ids.push(...got)
  }
  return { ids, t0, first, last }
}

interface RunResult { tokS: number, msPerToken: number, tokens: number, ids0: number[] }

/** `streams` completions at once; tok/s over the whole run, mean per-stream decode ms/token. */
async function run (url: string, streams: number): Promise<RunResult> {
  const rs = await Promise.all(Array.from({ length: streams }, async (_, i) => await streamCompletion(url, streamPromptIds(i, PROMPT))))
  const start = Math.min(...rs.map(r => r.t0))
  const end = Math.max(...rs.map(r => r.last))
  const tokens = rs.reduce((a, r) => a + r.ids.length, 0)
  const perStream = rs.map(r => (r.last - r.first) / Math.max(1, r.ids.length - 1))
  return { tokS: tokens / ((end - start) / 1000), msPerToken: perStream.reduce((a, b) => a + b, 0) / streams, tokens, ids0: rs[0]!.ids }
}

async function modelListed (url: string, boundMs: number): Promise<void> {
  const until = Date.now() + boundMs
  for (;;) {
    try {
      const res = await fetch(`${url}/v1/models`, { signal: AbortSignal.timeout(5000) })
      const ids = ((await res.json()) as { data?: Array<{ id: string }> }).data?.map(m => m.id) ?? []
      if (ids.includes(MODEL)) return
    } catch { /* not up yet */ }
    if (Date.now() > until) throw new Error(`${url}/v1/models did not list ${MODEL} within ${boundMs} ms`)
    await sleep(250)
  }
}

// ---------------------------------------------------------------------------------------------

async function main (): Promise<void> {
  const cores = availableParallelism()
  const hasTaskset = spawnSync('taskset', ['-c', '0', 'true']).status === 0
  const pin = hasTaskset && cores >= 2
  if (!pin) console.log(`note: no core pinning (${hasTaskset ? `only ${cores} core(s)` : 'taskset not found'}); every daemon shares all cores`)
  const core = (n: number): number | undefined => pin ? n : undefined
  const load0 = loadavg()
  const began = Date.now()
  const root = await mkdtemp(join(tmpdir(), 'shoal-bench-pinned-'))
  try {
    const ckpt = join(root, 'ckpt')
    await generateTestModel({ architecture: 'llama', size: '60m', outDir: ckpt, seed: 4 })
    const whole = join(root, 'whole')
    const two = join(root, 'two')
    const wm = await compileShards({ modelDir: ckpt, outDir: whole, modelId: MODEL, quant: QUANT, ...ACTIVATIONS })
    const tm = await compileShards({ modelDir: ckpt, outDir: two, modelId: MODEL, quant: QUANT, ...ACTIVATIONS, stages: 2 })
    const [l0, l1] = tm.stages.map(s => s.layers)
    const range = (l: number[]): string => `${l[0]}-${l.at(-1)}`
    const ca = await createThrowawayCa(join(root, 'pki'), ['stage0', 'stage1'])
    const [ia, ib] = ca.identities
    const cache = join(root, 'cache')
    const mesh = ['--device', 'cpu', '--no-mdns', '--listen', '/ip4/127.0.0.1/udp/0/quic-v1']

    let soloUrl = ''
    await daemons.spawn('unsplit serve', ['serve', '--model', whole, '--api', '127.0.0.1:0', '--device', 'cpu'], core(0), cache, line => {
      const m = /^shoal: serving \S+ at (\S+)\/v1/.exec(line)
      if (m !== null) soloUrl = m[1]!
      return m !== null
    })
    let chainUrl = ''
    const addrsA: string[] = []
    await daemons.spawn('stage 0', ['node', '--identity', ia!.dir, '--model', `${two}@${range(l0!)}`, '--api', '127.0.0.1:0', '--data', join(root, 'data-a'), ...mesh], core(0), cache, line => {
      const up = /^shoal: node \S+ up, API at (\S+)\/v1/.exec(line)
      if (up !== null) chainUrl = up[1]!
      const l = /^\s+listening on (\S+)/.exec(line)
      if (l !== null) addrsA.push(l[1]!)
      return l !== null
    })
    await daemons.spawn('stage 1', ['node', '--identity', ib!.dir, '--model', `${two}@${range(l1!)}`, '--data', join(root, 'data-b'), ...addrsA.flatMap(a => ['--bootstrap', a]), ...mesh], core(1), cache, line => /^\s+listening on /.test(line))
    await modelListed(soloUrl, 60_000)
    await modelListed(chainUrl, 120_000)

    const configs = [
      { label: 'unsplit, 1 stream (baseline)', url: soloUrl, streams: 1, chain: false },
      ...STREAMS.map(s => ({ label: `2-stage chain, ${s === 1 ? '1 stream (naive)' : `${s} streams (interleaved)`}`, url: chainUrl, streams: s, chain: true })),
    ]
    // Warm-up: every configuration once (first sessions, chain formation, JIT).
    for (const c of configs) await run(c.url, c.streams)
    const rounds: RunResult[][] = configs.map(() => [])
    const loadBefore = loadavg()
    for (let r = 0; r < ROUNDS; r++) {
      for (const [i, c] of configs.entries()) rounds[i]!.push(await run(c.url, c.streams))
      console.error(`round ${r + 1}/${ROUNDS}: ${rounds.map(x => x[r]!.tokS.toFixed(1)).join(' / ')} tok/s`)
    }
    const loadAfter = loadavg()

    const results = rounds.map(rs => upperMedianBy(rs, r => r.tokS)!)
    const base = results[0]!
    const naiveIdx = configs.findIndex(c => c.chain && c.streams === 1)
    const naive = naiveIdx < 0 ? undefined : results[naiveIdx]
    const f = (x: number, d = 2): string => Number.isFinite(x) ? x.toFixed(d) : '–'

    console.log(`machine: ${cores} cores (pinning ${pin ? 'on: serve + stage 0 on core 0, stage 1 on core 1; client unpinned' : 'off'}); Node ${process.version}`)
    console.log(`load average: at start ${formatLoad(load0, 2)}; before rounds ${formatLoad(loadBefore, 2)}; after rounds ${formatLoad(loadAfter, 2)}`)
    console.log(`model: 60m llama (${wm.shape.numLayers} layers, hidden ${wm.shape.hiddenSize}, vocab ${wm.shape.vocabSize}), quant ${QUANT}${QUANT !== 'none' ? (args['f32-activations'] === true ? ' (f32 activations)' : ' (int8 activations)') : ''}; stages ${range(l0!)} / ${range(l1!)}; prompt ${PROMPT} tokens, max_tokens ${TOKENS}, greedy; ${ROUNDS} rounds, median shown; total ${((Date.now() - began) / 1000).toFixed(0)} s`)
    console.log('greedy token ids vs unsplit (round 1, stream 0):')
    const soloIds = rounds[0]![0]!.ids0
    for (const [i, c] of configs.entries()) {
      if (!c.chain) continue
      const ids = rounds[i]![0]!.ids0
      const diverge = ids.findIndex((x, k) => x !== soloIds[k])
      const same = ids.length === soloIds.length && diverge < 0
      console.log(`  ${c.label}: ${same ? `identical (${ids.length} tokens)` : `DIFFERENT (${ids.length} vs ${soloIds.length} tokens, first difference at ${diverge < 0 ? Math.min(ids.length, soloIds.length) : diverge})`}`)
    }
    console.log('')
    console.log('| run | streams | tok/s (median; each round) | × unsplit | × naive chain | ms/token per stream | tokens per run |')
    console.log('|---|---:|---:|---:|---:|---:|---:|')
    for (const [i, c] of configs.entries()) {
      const r = results[i]!
      const vsNaive = c.chain && naive !== undefined ? f(r.tokS / naive.tokS) : '–'
      console.log(`| ${c.label} | ${c.streams} | ${f(r.tokS, 1)} (${rounds[i]!.map(x => f(x.tokS, 1)).join(' / ')}) | ${f(r.tokS / base.tokS)} | ${vsNaive} | ${f(r.msPerToken)} | ${r.tokens} |`)
    }
  } finally {
    await daemons.stop()
    await rm(root, { recursive: true, force: true })
  }
}

await main()
