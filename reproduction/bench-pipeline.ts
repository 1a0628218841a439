/**
 * Pipeline chain benchmark, side by side in one run: the unsplit model (one stream) against a
 * 2-stage chain over real libp2p nodes on loopback (TCP + noise + yamux), naive (one stream) and
 * interleaved (2 and 4 concurrent streams), with 0, 20 and 100 ms added per hop. Prints tok/s,
 * ratios to the baseline and per-token time split into compute, wait (queued behind another
 * request at a stage engine) and transfer (everything else on the round trip: framing, loopback,
 * simulated latency). Stages run in-process, each engine in its own worker thread (1 intra-op
 * thread); no core pinning. `--batching off,on` runs each chain both ways: `off`, every request
 * steps a stage's engine alone (FIFO in its worker); `on`, the steps waiting for a stage go
 * through its micro-batcher and share engine runs, as the daemon serves them (no compute/wait
 * split then: a shared run is not one request's).
 *
 *   node reproduction/bench-pipeline.ts [--size 60m] [--quant int4] [--tokens 64] [--prompt 16] [--delays 0,20,100] [--batching off,on] [--streams 1,2,4] [--rounds 3]
 */
import { mkdtemp, rm } from 'node:fs/promises'
import { cpus, loadavg, tmpdir } from 'node:os'
import { join } from 'node:path'
import { parseArgs } from 'node:util'
import { createBatcher } from '../daemon/batcher/index.ts'
import type { Batcher } from '../daemon/batcher/index.ts'
import { createBatchedExecutor, createStageEngine, GREEDY_PICK, stageInfoOf } from '../daemon/engine/index.ts'
import type { BatchingStageEngine, StageEngine, TokenSource } from '../daemon/engine/index.ts'
import { createChainTokenSource, createStageNode, manifestHashOf } from '../daemon/pipeline/index.ts'
import type { StageNode } from '../daemon/pipeline/index.ts'
import { compileShards, generateTestModel, loadManifest } from '../shards/index.ts'
import { streamPromptIds, tokenOf, upperMedianBy } from './lib/index.ts'
import { linkComponents, loopbackNode } from './lib/loopback.ts'
import { execWithServeMalloc } from './lib/malloc.ts'

// The engine runs in this process, and in any child that inherits its environment: with `shoal
// serve`'s malloc settings, as served (reproduction/lib/malloc.ts).
execWithServeMalloc()

const { values: args } = parseArgs({
  options: {
    size: { type: 'string', default: '60m' },
    quant: { type: 'string', default: 'int4' },
    tokens: { type: 'string', default: '64' },
    prompt: { type: 'string', default: '16' },
    delays: { type: 'string', default: '0,20,100' },
    batching: { type: 'string', default: 'off,on' },
    streams: { type: 'string', default: '1,2,4' },
    rounds: { type: 'string', default: '3' },
  },
})
const TOKENS = Number(args.tokens)
const PROMPT = Number(args.prompt)
const DELAYS = (args.delays ?? '0').split(',').map(Number)
const BATCHING = (args.batching ?? 'off').split(',').map(b => b === 'on')
const STREAMS = (args.streams ?? '1').split(',').map(Number)
const ROUNDS = Number(args.rounds)

/** Per-sequence compute and queue wait of decode steps at one engine (its worker runs steps one at a time, FIFO). */
interface Timed { engine: StageEngine, raw: BatchingStageEngine, bySeq: Map<string, { compute: number, wait: number }> }
function timed (engine: BatchingStageEngine): Timed {
  const bySeq = new Map<string, { compute: number, wait: number }>()
  let lastEnd = 0
  const wrapped: StageEngine = {
    get stage () { return engine.stage },
    start: () => engine.start(),
    stop: () => engine.stop(),
    open: (id, s) => engine.open(id, s),
    free: (id) => engine.free(id),
    stats: (s) => engine.stats(s),
    async step (seq, input, positions, options, signal) {
      const t0 = performance.now()
      const out = await engine.step(seq, input, positions, options, signal)
      const t1 = performance.now()
      const began = Math.max(t0, lastEnd)
      lastEnd = t1
      if (positions.length !== 1) return out // prefill: not part of the per-token split
      const e = bySeq.get(seq) ?? { compute: 0, wait: 0 }
      e.compute += t1 - began
      e.wait += began - t0
      bySeq.set(seq, e)
      return out
    },
  }
  return { engine: wrapped, raw: engine, bySeq }
}

interface RunResult { label: string, tokS: number, compute: number, wait: number, transfer: number, perToken: number }

/** Runs `streams` requests at once; decode tokens/s over the whole run and the per-token split. */
async function run (label: string, streams: number, makeSource: (i: number) => TokenSource & { close?: () => Promise<void> }, engines: Timed[]): Promise<RunResult> {
  for (const t of engines) t.bySeq.clear()
  const decodeMs: number[] = []
  const t0 = performance.now()
  await Promise.all(Array.from({ length: streams }, async (_, i) => {
    const src = makeSource(i)
    const signal = AbortSignal.timeout(600_000)
    const p = streamPromptIds(i, PROMPT)
    let tok = await src.prefill(p, signal)
    const d0 = performance.now()
    for (let n = 1; n < TOKENS; n++) tok = await src.decode(tok, p.length + n - 1, signal)
    decodeMs.push(performance.now() - d0)
    await src.close?.()
  }))
  const wall = performance.now() - t0
  let compute = 0
  let wait = 0
  for (const t of engines) for (const v of t.bySeq.values()) { compute += v.compute; wait += v.wait }
  const tokens = streams * TOKENS
  const total = decodeMs.reduce((a, b) => a + b, 0)
  const perTok = (x: number): number => x / (streams * (TOKENS - 1))
  const perToken = total / (streams * (TOKENS - 1))
  return { label, tokS: tokens / (wall / 1000), compute: perTok(compute), wait: perTok(wait), transfer: Math.max(0, perToken - perTok(compute) - perTok(wait)), perToken }
}

async function main (): Promise<void> {
  const root = await mkdtemp(join(tmpdir(), 'shoal-bench-pipeline-'))
  try {
    const ckpt = join(root, 'ckpt')
    await generateTestModel({ architecture: 'llama', outDir: ckpt, size: args.size as '60m' })
    const quant = args.quant as 'none' | 'int4'
    await compileShards({ modelDir: ckpt, outDir: join(root, 'whole'), modelId: 'bench', quant })
    await compileShards({ modelDir: ckpt, outDir: join(root, 'two'), modelId: 'bench', quant, stages: 2 })
    const whole = await loadManifest(join(root, 'whole'))
    const two = await loadManifest(join(root, 'two'))
    const hash = await manifestHashOf(join(root, 'two'))
    // Room for two runs' sequences: a finished run's are freed by cancel frames that the simulated
    // hop delay holds back while the next run opens its own.
    const maxSequences = Math.max(8, 2 * Math.max(...STREAMS))
    const engineFor = (dir: string, m: typeof whole, i: number): Timed => timed(createStageEngine({ graphPath: join(dir, ...m.stages[i]!.graph.split('/')), stage: stageInfoOf(m, i), threads: 1, maxSequences }))

    // Everything is started up front; configurations then run in rounds (each round runs every
    // configuration once) and the median round is reported, so drift in machine load hits all alike.
    const w = engineFor(join(root, 'whole'), whole, 0)
    await w.engine.start()
    const localSource = (i: number): TokenSource & { close: () => Promise<void> } => {
      const seq = `local-${i}-${Math.random()}`
      let opened = false
      // Greedy, picked in the worker as the chain's last stage does.
      const greedy = { pick: GREEDY_PICK }
      return {
        async prefill (ids, signal) { await w.engine.open(seq, signal); opened = true; return tokenOf(await w.engine.step(seq, { tokenIds: ids }, ids.map((_, j) => j), greedy, signal)) },
        async decode (id, pos, signal) { return tokenOf(await w.engine.step(seq, { tokenIds: [id] }, [pos], greedy, signal)) },
        async close () { if (opened) await w.engine.free(seq) },
      }
    }
    const configs: Array<{ label: string, streams: number, source: (i: number) => TokenSource & { close?: () => Promise<void> }, engines: Timed[], batched: boolean }> = [
      { label: 'unsplit, 1 stream (baseline)', streams: 1, source: localSource, engines: [w], batched: false },
    ]
    const teardown: Array<() => Promise<void>> = [async () => { await w.engine.stop() }]
    for (const delayMs of DELAYS) {
      for (const batching of BATCHING) {
        const libp2ps = [await loopbackNode(), await loopbackNode()]
        const byId = new Map(libp2ps.map(n => [n.peerId.toString(), n]))
        const engines = [engineFor(join(root, 'two'), two, 0), engineFor(join(root, 'two'), two, 1)]
        const batchers: Batcher[] = batching ? engines.map((e, i) => createBatcher({ name: `stage-${i}` }, { executor: createBatchedExecutor(e.raw), batchCap: () => nodes[i]!.waveCap() })) : []
        const nodes: StageNode[] = libp2ps.map((n, i) => createStageNode({ engine: engines[i]!.engine, ...(batching ? { batcher: batchers[i]! } : {}), modelId: 'bench', manifestHash: hash, delayMs }, linkComponents(n, byId)))
        for (const [i, nd] of nodes.entries()) { await engines[i]!.engine.start(); await batchers[i]?.start(); await nd.start() }
        const chain = [{ peerId: nodes[0]!.peerId, layers: two.stages[0]!.layers }, { peerId: nodes[1]!.peerId, layers: two.stages[1]!.layers }]
        let k = 0
        const chainSource = (): ReturnType<typeof createChainTokenSource> => createChainTokenSource({
          node: nodes[0]!, requestId: `b${delayMs}${batching ? 'b' : ''}-${k++}`, sampling: { temperature: 0, topP: 1 }, deadline: Date.now() + 600_000, formChain: () => chain,
        })
        for (const streams of STREAMS) {
          const mode = streams > 1 ? `${streams} streams (interleaved${batching ? ', batched' : ''})` : `1 stream (naive${batching ? ', batcher' : ''})`
          configs.push({ label: `2-stage, ${mode}, +${delayMs} ms/hop`, streams, source: chainSource, engines, batched: batching })
        }
        teardown.push(async () => {
          for (const nd of nodes) await nd.stop()
          for (const b of batchers) await b.stop()
          for (const e of engines) await e.engine.stop()
          for (const n of libp2ps) await n.stop()
        })
      }
    }
    for (const c of configs) await run('warm-up', 1, c.source, c.engines)
    const rounds: RunResult[][] = configs.map(() => [])
    const loadBefore = loadavg()[0]!
    for (let r = 0; r < ROUNDS; r++) {
      for (const [i, c] of configs.entries()) rounds[i]!.push(await run(c.label, c.streams, c.source, c.engines))
    }
    const loadAfter = loadavg()[0]!
    for (const t of teardown) await t()
    const results = rounds.map(rs => upperMedianBy(rs, r => r.tokS)!)
    const base = results[0]!

    const f = (x: number, d = 2): string => x.toFixed(d)
    console.log(`machine: ${cpus().length} cores, load average ${loadBefore.toFixed(1)} before / ${loadAfter.toFixed(1)} after; ${ROUNDS} rounds, median shown`)
    console.log(`model: ${args.size} llama (${whole.shape.numLayers} layers, hidden ${whole.shape.hiddenSize}, vocab ${whole.shape.vocabSize}), quant ${quant}; prompt ${PROMPT}, ${TOKENS} tokens per stream`)
    console.log('| run | tok/s (median; each round) | × unsplit | ms/token per stream | compute | wait | transfer |')
    console.log('|---|---:|---:|---:|---:|---:|---:|')
    for (const [i, r] of results.entries()) {
      // Through a batcher the engine's step is not timed per request: no split.
      const split = configs[i]!.batched ? '– | – | –' : `${f(r.compute)} | ${f(r.wait)} | ${f(r.transfer)}`
      console.log(`| ${r.label} | ${f(r.tokS, 1)} (${rounds[i]!.map(x => f(x.tokS, 0)).join('/')}) | ${f(r.tokS / base.tokS)} | ${f(r.perToken)} | ${split} |`)
    }
  } finally {
    await rm(root, { recursive: true, force: true })
  }
}

await main()
