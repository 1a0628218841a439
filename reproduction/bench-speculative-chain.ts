/**
 * Speculative decoding across a pipeline chain: single-stream greedy decode tok/s of a 2- or
 * 3-stage chain (real libp2p nodes on loopback, one process, every received frame delayed by the
 * hop time) without speculation and with a draft model on the coordinator for K in a sweep and
 * adaptive, at several per-hop latencies and two agreement levels (ε of generateDraftPair). Every
 * configuration's tokens are checked equal to the plain chain's. The paper's 3-stage table
 * (tok/s at LAN / 50 / 100 ms per hop) is printed beside it for shape, not for absolute numbers.
 *
 * Run: node reproduction/bench-speculative-chain.ts [--size small] [--layers 12] [--stages 3]
 *        [--epsilon 0.02,0.1] [--hops 0,20,50,100] [--k 1,2,3,5,7,10,adaptive] [--tokens 48] [--quant none|int4]
 *        [--task random|copy] [--copy-prompt copy|fresh|mixed] [--streams 1]
 * `--task copy` measures prompt lookup on the chain where it should pay (wave 39: a chain coordinator
 * runs it by default): a successor model of `--layers` layers (greedy next token = a fixed cycle's
 * next token; ε of its successor option from `--epsilon`) given bench-speculative.ts's "rewrite
 * this text with one change" prompt, so the continuation is text the prompt holds. It runs plain,
 * the default lookup (`lookup-default`: what a coordinator without `--draft` runs) and `--draft
 * lookup`'s (`lookup`, adaptive K), and `lookup-2`: the default's two-token matches without its
 * rule of speculating only while alone; `--k` is ignored there. `--copy-prompt fresh`: a prompt whose
 * continuation it never holds (what lookup costs where nothing repeats); `mixed`: streams alternate
 * the two (copy on even streams), and each half's tok/s is printed too (its first token to its last). `--streams N`: N requests
 * at once a measurement (tok/s over all of them, first token to last).
 * `--quant int4`: the target's shards int4 with int8 activations (the compiler's default), every
 * stage on shoal's kernels (the verify attention on each, so the chain verifies exactly), and the
 * coordinator forming chains only of stages that say so, as `shoal node` does.
 * Models are generated and compiled once into .cache/bench/.
 */
import { existsSync } from 'node:fs'
import { cpus } from 'node:os'
import { join, resolve } from 'node:path'
import { performance } from 'node:perf_hooks'
import { parseArgs } from 'node:util'
import type { Libp2p } from '@libp2p/interface'
import { createPipelineService, createPipelineStage } from '../daemon/pipeline/index.ts'
import type { ChainSourceWrapper, PipelineService, PipelineStage } from '../daemon/pipeline/index.ts'
import type { StageHolder } from '../daemon/routing/index.ts'
import { createPromptLookupDrafter, createSpeculation, DEFAULT_LOOKUP_MIN_NGRAM, exactVerifyNeeds } from '../daemon/speculative/index.ts'
import type { Speculation, SpeculationCounts } from '../daemon/speculative/index.ts'
import { compileShards, copyTaskPrompt, generateDraftPair, generateTestModel, loadManifest, successorCycle } from '../shards/index.ts'
import type { TestModelSize } from '../shards/index.ts'
import { loadAverage } from './lib/index.ts'
import { linkComponents, loopbackNode } from './lib/loopback.ts'
import { execWithServeMalloc } from './lib/malloc.ts'
import { nodeKernels, nodeTargetKernels } from './lib/native-kernels.ts'

// The engine runs in this process, and in any child that inherits its environment: with `shoal
// serve`'s malloc settings, as served (reproduction/lib/malloc.ts).
execWithServeMalloc()

const { values: args } = parseArgs({
  options: {
    size: { type: 'string', default: 'small' },
    layers: { type: 'string', default: '12' },
    stages: { type: 'string', default: '3' },
    epsilon: { type: 'string', default: '0.02,0.1' },
    hops: { type: 'string', default: '0,20,50,100' },
    k: { type: 'string', default: '1,2,3,5,7,10,adaptive' },
    tokens: { type: 'string', default: '48' },
    quant: { type: 'string', default: 'none' },
    task: { type: 'string', default: 'random' },
    'copy-prompt': { type: 'string', default: 'copy' },
    streams: { type: 'string', default: '1' },
  },
})
if (args.task !== 'random' && args.task !== 'copy') throw new Error(`--task ${args.task}: random or copy`)
if (!['copy', 'fresh', 'mixed'].includes(args['copy-prompt'])) throw new Error(`--copy-prompt ${args['copy-prompt']}: copy, fresh or mixed`)
const COPY_TASK = args.task === 'copy'
const STREAMS = Math.max(1, Number(args.streams))
const MIXED = COPY_TASK && args['copy-prompt'] === 'mixed' && STREAMS > 1
/**
 * The copy task's prompt (bench-speculative.ts's): 24 unrelated tokens, 300 of the cycle with one
 * changed, a separator; `--copy-prompt fresh`: 327 tokens of the cycle read backwards, then the
 * start, so the continuation runs through tokens the prompt never holds (lookup proposes nothing).
 */
const CYCLE = successorCycle('llama')
const COPY_IDS = copyTaskPrompt({ cycle: CYCLE, length: 300, change: 100, prefix: 24 }).ids
const FRESH_IDS = [...Array.from({ length: 327 }, (_, i) => CYCLE[((-1 - i) % CYCLE.length + CYCLE.length) % CYCLE.length]!), CYCLE[0]!]
/** Stream i's prompt: `mixed` alternates copy (even streams) and fresh (odd ones). */
const promptOf = (i: number): number[] => args['copy-prompt'] === 'fresh' || (args['copy-prompt'] === 'mixed' && i % 2 === 1) ? FRESH_IDS : COPY_IDS
if (args.quant !== 'none' && args.quant !== 'int4') throw new Error(`--quant ${args.quant}: none or int4`)
const QUANT = args.quant as 'none' | 'int4'
const LAYERS = Number(args.layers)
const STAGES = Number(args.stages)
const TOKENS = Number(args.tokens)
const PROMPT = 'The quick brown fox jumps over the lazy dog. Once upon a time, in a land far away, there lived'
const PAPER = 'paper (3 stages, tok/s at LAN / 50 / 100 ms): K=2 28.6 / 10.3 / 6.5 · K=5 30.4 / 14.1 / 9.3 · K=7 31.0 / 15.3 / 10.5 · K=10 28.0 / 16.0 / 11.3'

function ranges (): Array<[number, number]> {
  const per = Math.ceil(LAYERS / STAGES)
  return Array.from({ length: STAGES }, (_, i) => [i * per, Math.min(LAYERS, (i + 1) * per) - 1] as [number, number])
}

async function prepare (epsilon: string): Promise<{ chain: string, draft?: string }> {
  const dir = resolve(import.meta.dirname, '..', '.cache', 'bench', `spec-chain-${COPY_TASK ? 'copy-' : ''}${args.size}-${LAYERS}-e${epsilon}-s${STAGES}${QUANT === 'none' ? '' : `-${QUANT}`}`)
  if (COPY_TASK) {
    const chain = join(dir, 'chain')
    if (existsSync(join(chain, 'manifest.json'))) return { chain }
    await generateTestModel({ architecture: 'llama', outDir: join(dir, 'ckpt'), size: args.size as TestModelSize, layers: LAYERS, successor: { epsilon: Number(epsilon) } })
    await compileShards({ modelDir: join(dir, 'ckpt'), outDir: chain, modelId: 'target', layers: ranges(), ...(QUANT === 'none' ? {} : { quant: QUANT }) })
    return { chain }
  }
  const chain = join(dir, 'chain')
  const draft = join(dir, 'draft')
  if (existsSync(join(chain, 'manifest.json')) && existsSync(join(draft, 'manifest.json'))) return { chain, draft }
  const ck = await generateDraftPair({ architecture: 'llama', outDir: join(dir, 'ckpt'), size: args.size as TestModelSize, draftLayers: 1, extraLayers: LAYERS - 1, epsilon: Number(epsilon), targetId: 'target' })
  await compileShards({ modelDir: ck.targetDir, outDir: chain, layers: ranges(), ...(QUANT === 'none' ? {} : { quant: QUANT }) })
  await compileShards({ modelDir: ck.draftDir, outDir: draft, ...(QUANT === 'none' ? {} : { quant: QUANT }) })
  return { chain, draft }
}

const book = new Map<string, Libp2p>()
async function host (dir: string, layers: [number, number], delayMs: number, lib: { kernels?: string }): Promise<{ libp2p: Libp2p, stage: PipelineStage }> {
  const libp2p = await loopbackNode()
  book.set(libp2p.peerId.toString(), libp2p)
  const components = linkComponents(libp2p, book)
  const stage = await createPipelineStage({ shardDir: dir, layers, threads: 1, delayMs, ...lib }, components)
  await stage.start()
  return { libp2p, stage }
}

/**
 * STREAMS greedy requests at once (the same prompt): tok/s over all of them from the first token
 * to the last, and each stream's tokens (`--streams 1`: one stream, first to last token).
 */
async function decode (svc: PipelineService, config: string): Promise<{ tokS: number, tokens: number[][], evenTokS: number, oddTokS: number }> {
  const spans: Array<{ first: number, last: number }> = []
  const one = async (i: number): Promise<number[]> => {
    const prompt = COPY_TASK ? { kind: 'tokens' as const, ids: promptOf(i) } : { kind: 'text' as const, text: PROMPT }
    const tokens: number[] = []
    const span = { first: Infinity, last: 0 }
    spans[i] = span
    for await (const e of svc.generate({ requestId: `${config}#${performance.now()}-${i}`, model: 'target', prompt, maxTokens: TOKENS, sampling: { temperature: 0, topP: 1 }, stop: [], deadline: Date.now() + 600_000 }, new AbortController().signal)) {
      if (e.type === 'delta') { if (tokens.length === 0) span.first = performance.now(); tokens.push(...e.tokenIds); span.last = performance.now() }
    }
    return tokens
  }
  const tokens = await Promise.all(Array.from({ length: STREAMS }, async (_, i) => await one(i)))
  /** Tokens a second over the streams `which`, from their first token to their last. */
  const rate = (which: number[]): number => (which.reduce((n, i) => n + tokens[i]!.length, 0) - 1) * 1000 / (Math.max(...which.map(i => spans[i]!.last)) - Math.min(...which.map(i => spans[i]!.first)))
  const all = tokens.map((_, i) => i)
  return { tokS: rate(all), tokens, evenTokS: STREAMS > 1 ? rate(all.filter(i => i % 2 === 0)) : NaN, oddTokS: STREAMS > 1 ? rate(all.filter(i => i % 2 === 1)) : NaN }
}

async function main (): Promise<void> {
  process.stdout.write(`# ${STAGES}-stage chain, ${args.size} width, ${LAYERS} target layers${QUANT === 'none' ? '' : ` (${QUANT}, int8 activations, shoal's kernels)`}, ${COPY_TASK ? `copy task (successor model, ${args['copy-prompt']} prompts), prompt lookup` : 'draft = 1 layer'}; ${STREAMS} stream${STREAMS === 1 ? '' : 's at once'}; ${cpus().length} cores, load ${loadAverage()}\n# ${PAPER}\n`)
  const ks = COPY_TASK ? ['lookup-default', 'lookup-2', 'lookup'] : args.k.split(',')
  const hops = args.hops.split(',').map(Number)
  for (const epsilon of args.epsilon.split(',')) {
    const { chain, draft } = await prepare(epsilon)
    const manifest = await loadManifest(chain)
    const lib = await nodeKernels(manifest)
    const kernels = nodeTargetKernels(manifest, lib)
    const needs = exactVerifyNeeds(manifest)
    const table = new Map<string, string[]>()
    const acceptance = new Map<string, number[]>()
    for (const hopMs of hops) {
      const hosts: Array<{ libp2p: Libp2p, stage: PipelineStage }> = []
      for (const r of ranges()) hosts.push(await host(chain, r, hopMs, lib))
      const counts = new Map<string, SpeculationCounts[]>()
      const configs: Record<string, Speculation> = {}
      const onRequestEnd = (id: string, c: SpeculationCounts): void => { const key = id.split('#')[0]!; counts.set(key, [...(counts.get(key) ?? []), c]) }
      for (const k of ks) {
        configs[k] = k === 'lookup-2'
          ? createSpeculation({ drafter: createPromptLookupDrafter({ minNgram: DEFAULT_LOOKUP_MIN_NGRAM }), targetKernels: kernels, onRequestEnd })
          : k.startsWith('lookup')
          ? createSpeculation({ drafter: 'prompt-lookup', ...(k === 'lookup-default' ? { byDefault: true } : {}), targetKernels: kernels, onRequestEnd })
          : createSpeculation({ drafter: { draftDir: draft!, ...lib }, targetKernels: kernels, k: k === 'adaptive' ? 'adaptive' : Number(k), threads: 1, onRequestEnd })
      }
      const wrapper: ChainSourceWrapper = {
        async start (t) { for (const s of Object.values(configs)) await s.start!(t) },
        async stop () { for (const s of Object.values(configs)) await s.stop!() },
        wrapChain: (ctx) => configs[ctx.request.requestId.split('#')[0]!]!.wrapChain(ctx),
      }
      const holders = (): StageHolder[] => hosts.slice(1).map(h => { const s = h.stage.served(); return { peerId: h.libp2p.peerId.toString(), modelId: s.id, manifestHash: s.manifestHash, layers: s.layers, admitted: true, alive: true, rttMs: 1, kernels } })
      const plain = createPipelineService({ stage: hosts[0]!.stage, shardDir: chain }, { holders })
      const spec = createPipelineService({ stage: hosts[0]!.stage, shardDir: chain, sourceWrapper: wrapper, kernels, ...(needs === undefined ? {} : { speculationKernels: needs }) }, { holders })
      await plain.start()
      await spec.start()
      await decode(plain, 'warm')
      const base = await decode(plain, 'plain')
      table.set('plain', [...(table.get('plain') ?? []), `${base.tokS.toFixed(1)}${MIXED ? ` [copy streams ${base.evenTokS.toFixed(1)}; fresh ${base.oddTokS.toFixed(1)}]` : ''}`])
      for (const k of ks) {
        const r = await decode(spec, k)
        if (r.tokens.some((t, i) => t.join() !== base.tokens[i]!.join())) process.stdout.write(`  K=${k} at ${hopMs} ms: tokens differ from the plain chain!\n`)
        // This measurement's streams, summed.
        const c = counts.get(k)!.slice(-STREAMS).reduce((a, x) => ({ rounds: a.rounds + x.rounds, drafted: a.drafted + x.drafted, accepted: a.accepted + x.accepted }), { rounds: 0, drafted: 0, accepted: 0 })
        acceptance.set(k, [...(acceptance.get(k) ?? []), c.drafted === 0 ? NaN : c.accepted / c.drafted])
        const odd = MIXED ? ` [copy streams ${r.evenTokS.toFixed(1)}, ${(r.evenTokS / base.evenTokS).toFixed(2)}×; fresh ${r.oddTokS.toFixed(1)}, ${(r.oddTokS / base.oddTokS).toFixed(2)}×]` : ''
        table.set(k, [...(table.get(k) ?? []), `${r.tokS.toFixed(1)}${odd} (${(r.tokS / base.tokS).toFixed(2)}×${k !== 'adaptive' && !k.startsWith('lookup') ? '' : c.rounds > 0 ? `, K̄ ${(c.drafted / c.rounds).toFixed(1)}` : ', no round'})`])
      }
      await spec.stop()
      await plain.stop()
      for (const h of hosts) { await h.stage.stop(); await h.libp2p.stop() }
    }
    process.stdout.write(`\n## ε = ${epsilon}\n\n| K | ${hops.map(h => `${h} ms/hop tok/s (× plain)`).join(' | ')} | acceptance |\n|---|${hops.map(() => '---|').join('')}---|\n`)
    for (const [k, cells] of table) {
      const acc = acceptance.get(k)
      const drafted = acc?.filter(a => !Number.isNaN(a)) ?? []
      process.stdout.write(`| ${k} | ${cells.join(' | ')} | ${drafted.length === 0 ? '—' : `${(100 * drafted.reduce((a, b) => a + b, 0) / drafted.length).toFixed(0)} %`} |\n`)
    }
  }
}

await main()
process.exit(0)
