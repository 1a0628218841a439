/**
 * Speculative decoding on one node: single-stream greedy decode tok/s of a target model plain vs
 * with a draft model (K swept, and adaptive) and with prompt lookup, measured side by side in one
 * process, reps alternating between configurations. The pair comes from generateDraftPair: the
 * draft is the target's first layer(s), the target adds layers whose output projections are
 * scaled by ε, so acceptance is tunable (random weights otherwise disagree on nearly every token).
 * Every configuration's tokens are checked equal to plain decoding's.
 *
 * --task copy measures prompt lookup where it should pay: a successor model of the same shape
 * (greedy next token = a fixed cycle's next token; shards/testmodel) given a "rewrite this text
 * with one change" prompt (copyTaskPrompt: unrelated tokens, a stretch of the cycle with one token
 * changed, a separator, the stretch's first token), so the continuation is text the prompt holds.
 * Only plain and lookup run there (--k is ignored: no draft model matches it). --copy-prompt picks
 * the prompt there: `copy` (the above), `fresh` (nothing repeats: 327 tokens of the cycle read
 * backwards from the text's start, so no generated token ever occurs earlier and lookup proposes
 * nothing), or `reversed` (lookup's worst case: the whole cycle read backwards, so every generated
 * token occurs earlier, followed by the wrong token: lookup proposes every step, and every round fails).
 *
 * --streams N runs N greedy requests at once per measurement (the micro-batcher batches their plain
 * steps; a verify step of several positions runs alone); tok/s is then all streams' tokens over the
 * wall time from the first token to the last. --lookup default measures what a node serving the
 * model without --draft runs (createSpeculation's byDefault: prompt lookup, adaptive K) against
 * plain decoding (what --draft none runs); --explicit yes adds what --draft lookup runs (one-token
 * matches drafted too), with adaptive K's probes backed off and evenly spaced.
 *
 * Run: node reproduction/bench-speculative.ts [--size 250m] [--vocab 0] [--layers 24] [--draft-layers 1]
 *        [--epsilon 0.02] [--quant int4] [--tokens 128] [--reps 3] [--k 1,2,4,6,8,adaptive|none] [--lookup yes|no]
 *        [--task random|copy] [--copy-prompt copy|fresh|reversed] [--reject 1,4|none] [--streams 1]
 *        [--lookup yes|no|default] [--explicit no|yes]
 * Models are generated and compiled once into .cache/bench/ and reused.
 */
import { existsSync } from 'node:fs'
import { cpus } from 'node:os'
import { join, resolve } from 'node:path'
import { performance } from 'node:perf_hooks'
import { parseArgs } from 'node:util'
import { createLocalService } from '../daemon/engine/index.ts'
import type { LocalService } from '../daemon/engine/index.ts'
import { createSpeculation } from '../daemon/speculative/index.ts'
import type { Drafter, SpeculationCounts } from '../daemon/speculative/index.ts'
import { compileShards, copyTaskPrompt, generateDraftPair, generateTestModel, loadManifest, successorCycle } from '../shards/index.ts'
import type { TestModelSize } from '../shards/index.ts'
import { loadAverage, lowerMedian } from './lib/index.ts'
import { nodeKernels, nodeTargetKernels } from './lib/native-kernels.ts'
import { execWithServeMalloc, mallocSettings } from './lib/malloc.ts'

// The engine runs in this process, and in any child that inherits its environment: with `shoal
// serve`'s malloc settings, as served (reproduction/lib/malloc.ts).
execWithServeMalloc()

const { values: args } = parseArgs({
  options: {
    size: { type: 'string', default: '250m' },
    vocab: { type: 'string', default: '0' },
    layers: { type: 'string', default: '24' },
    'draft-layers': { type: 'string', default: '1' },
    epsilon: { type: 'string', default: '0.02' },
    quant: { type: 'string', default: 'int4' },
    tokens: { type: 'string', default: '128' },
    reps: { type: 'string', default: '3' },
    k: { type: 'string', default: '1,2,4,6,8,adaptive' },
    lookup: { type: 'string', default: 'yes' },
    task: { type: 'string', default: 'random' },
    reject: { type: 'string', default: 'none' },
    'copy-prompt': { type: 'string', default: 'copy' },
    streams: { type: 'string', default: '1' },
    explicit: { type: 'string', default: 'no' },
  },
})
const TOKENS = Number(args.tokens)
const REPS = Number(args.reps)
const draftLayers = Number(args['draft-layers'])
const quant = args.quant as 'none' | 'int4' | 'int8'
const copyTask = args.task === 'copy'
const name = copyTask ? `copy-${args.size}-v${args.vocab}-${args.layers}-e${args.epsilon}-${quant}` : `spec-${args.size}-v${args.vocab}-${draftLayers}+${Number(args.layers) - draftLayers}-e${args.epsilon}-${quant}`
const dir = resolve(import.meta.dirname, '..', '.cache', 'bench', name)
const PROMPT = 'The quick brown fox jumps over the lazy dog. Once upon a time, in a land far away, there lived'

/** The copy task's prompt: 24 unrelated tokens, 300 tokens of text (one changed, a third in), a separator. */
const CYCLE = successorCycle('llama')
const COPY = copyTaskPrompt({ cycle: CYCLE, length: 300, change: 100, prefix: 24 })
const backwards = (count: number): number[] => Array.from({ length: count }, (_, i) => CYCLE[((-1 - i) % CYCLE.length + CYCLE.length) % CYCLE.length]!)
/** The copy task's prompt ids and the greedy continuation they lead to (the cycle after the last token). */
const COPY_PROMPT: { ids: number[], continuation: (n: number) => number[] } = (() => {
  const after = (last: number) => (n: number): number[] => { const i = CYCLE.indexOf(last); return Array.from({ length: n }, (_, j) => CYCLE[(i + 1 + j) % CYCLE.length]!) }
  if (args['copy-prompt'] === 'copy') return COPY
  // fresh: the text's start after 327 tokens that precede it in the cycle (read backwards): the
  // continuation runs forward from the start, through tokens the prompt never holds.
  if (args['copy-prompt'] === 'fresh') { const ids = [...backwards(327), CYCLE[0]!]; return { ids, continuation: after(CYCLE[0]!) } }
  // reversed: the whole cycle backwards; the continuation runs forward through tokens the prompt
  // holds in the opposite order.
  if (args['copy-prompt'] === 'reversed') { const ids = backwards(CYCLE.length); return { ids, continuation: after(ids[ids.length - 1]!) } }
  throw new Error(`--copy-prompt: ${args['copy-prompt']}`)
})()
const STREAMS = Math.max(1, Number(args.streams))

async function prepareCopy (): Promise<string> {
  const target = join(dir, 'target')
  if (existsSync(join(target, 'manifest.json'))) return target
  await generateTestModel({
    architecture: 'llama', outDir: join(dir, 'ckpt'), size: args.size as TestModelSize, vocab: Number(args.vocab),
    layers: Number(args.layers), successor: { epsilon: Number(args.epsilon) },
  })
  await compileShards({ modelDir: join(dir, 'ckpt'), outDir: target, quant })
  return target
}

async function prepare (): Promise<{ target: string, draft: string }> {
  const target = join(dir, 'target')
  const draft = join(dir, 'draft')
  if (existsSync(join(target, 'manifest.json')) && existsSync(join(draft, 'manifest.json'))) return { target, draft }
  const ck = await generateDraftPair({
    architecture: 'llama', outDir: join(dir, 'ckpt'), size: args.size as TestModelSize, vocab: Number(args.vocab),
    draftLayers, extraLayers: Number(args.layers) - draftLayers, epsilon: Number(args.epsilon),
  })
  await compileShards({ modelDir: ck.targetDir, outDir: target, quant })
  await compileShards({ modelDir: ck.draftDir, outDir: draft, quant })
  return { target, draft }
}

/**
 * cpuMsPerToken: the whole process's CPU time (every thread: the engine worker and onnxruntime's)
 * per decoded token. On a loaded machine wall time swings by tens of percent between reps, but
 * the CPU work a configuration does per token moves far less: it is what shows a few percent of cost.
 */
interface Measured { tokS: number, cpuMsPerToken: number, tokens: number[] }

async function measure (svc: LocalService, text: string): Promise<Measured> {
  let first: number | undefined
  let cpu0 = process.cpuUsage()
  let counted = 0
  const one = async (stream: number): Promise<number[]> => {
    const tokens: number[] = []
    for await (const e of svc.generate({
      requestId: `b${performance.now()}-${stream}`, model: svc.models()[0]!.id,
      prompt: copyTask ? { kind: 'tokens', ids: COPY_PROMPT.ids } : { kind: 'text', text }, maxTokens: TOKENS,
      sampling: { temperature: 0, topP: 1 }, stop: [], deadline: Date.now() + 600_000,
    }, new AbortController().signal)) {
      if (e.type !== 'delta') continue
      // Timed from the first token of any stream (prefills before it are not decode).
      if (first === undefined) { first = performance.now(); cpu0 = process.cpuUsage() } else counted += e.tokenIds.length
      tokens.push(...e.tokenIds)
    }
    return tokens
  }
  const all = await Promise.all(Array.from({ length: STREAMS }, async (_, i) => await one(i)))
  const cpu = process.cpuUsage(cpu0)
  // Every stream has the same prompt: their tokens must agree (checked against plain by the caller).
  for (const t of all) if (t.join() !== all[0]!.join()) process.stdout.write('  streams of one measurement differ!\n')
  return { tokS: counted * 1000 / (performance.now() - first!), cpuMsPerToken: (cpu.user + cpu.system) / 1000 / counted, tokens: all[0]! }
}

/** Proposes k copies of a token the target (almost) never picks: a special one, damped in the test models' heads. */
function rejectedDrafter (): Drafter {
  return {
    name: 'always-rejected',
    async open () { return { async propose ({ k }) { return { tokens: new Array<number>(k).fill(2) } }, async close () {} } },
  }
}

async function main (): Promise<void> {
  if (copyTask && TOKENS > 299) throw new Error('--task copy: at most 299 tokens (the prompt text is 300)')
  const { target, draft } = copyTask ? { target: await prepareCopy(), draft: '' } : await prepare()
  process.stdout.write(`# ${name}${copyTask ? ` (prompt: ${args['copy-prompt']})` : ''}, ${STREAMS} stream(s): ${cpus().length} cores (${cpus()[0]?.model}), load ${loadAverage()}, malloc: ${mallocSettings()}\n`)
  const configs: Array<{ label: string, svc: LocalService, counts: SpeculationCounts[] }> = []
  // The engine as a node runs it: shoal's kernels where they build here, which int4 targets need
  // to speculate exactly (targetKernels).
  const manifest = await loadManifest(target)
  const lib = await nodeKernels(manifest)
  const targetKernels = nodeTargetKernels(manifest, lib)
  const plain = createLocalService({ shardDir: target, ...lib })
  await plain.start()
  configs.push({ label: 'plain', svc: plain, counts: [] })
  const ks = copyTask || args.k === 'none' ? [] : args.k.split(',').map(k => k === 'adaptive' ? 'adaptive' as const : Number(k))
  for (const k of ks) {
    const counts: SpeculationCounts[] = []
    const svc = createLocalService({ shardDir: target, ...lib, sourceWrapper: createSpeculation({ targetKernels, drafter: { draftDir: draft }, k, onRequestEnd: (_id, c) => counts.push(c) }) })
    await svc.start()
    configs.push({ label: `draft K=${k}`, svc, counts })
  }
  if (args.lookup === 'default') {
    const counts: SpeculationCounts[] = []
    const svc = createLocalService({ shardDir: target, ...lib, sourceWrapper: createSpeculation({ targetKernels, drafter: 'prompt-lookup', byDefault: true, onRequestEnd: (_id, c) => counts.push(c) }) })
    await svc.start()
    configs.push({ label: 'lookup (default)', svc, counts })
    if (args.explicit === 'yes') {
      // What --draft lookup runs (adaptive K, one-token matches drafted), or that with adaptive K's
      // probes evenly spaced as before probe back-off.
      for (const [label, maxProbeEvery] of [['--draft lookup', undefined], ['--draft lookup, probes every 16', 16]] as const) {
        const c: SpeculationCounts[] = []
        const svc = createLocalService({ shardDir: target, ...lib, sourceWrapper: createSpeculation({ targetKernels, drafter: 'prompt-lookup', ...(maxProbeEvery === undefined ? {} : { maxProbeEvery }), onRequestEnd: (_id, x) => c.push(x) }) })
        await svc.start()
        configs.push({ label, svc, counts: c })
      }
    }
  } else if (args.lookup !== 'no') {
    for (const k of [4, 'adaptive'] as const) {
      const counts: SpeculationCounts[] = []
      const svc = createLocalService({ shardDir: target, ...lib, sourceWrapper: createSpeculation({ targetKernels, drafter: 'prompt-lookup', k, onRequestEnd: (_id, c) => counts.push(c) }) })
      await svc.start()
      configs.push({ label: `lookup K=${k}`, svc, counts })
    }
  }
  // What a round whose drafts all fail costs over a plain step (verify K + 1 positions, roll K
  // back): every step here is such a round, so the cost shows above the machine's noise, and a
  // drafter's cost where nothing repeats is about (its rounds / steps) × this row's slowdown.
  for (const k of args.reject === 'none' ? [] : args.reject.split(',').map(Number)) {
    const counts: SpeculationCounts[] = []
    const svc = createLocalService({ shardDir: target, ...lib, sourceWrapper: createSpeculation({ targetKernels, drafter: rejectedDrafter(), k, onRequestEnd: (_id, c) => counts.push(c) }) })
    await svc.start()
    configs.push({ label: `always rejected K=${k}`, svc, counts })
  }
  const results = new Map<string, number[]>()
  const cpuMs = new Map<string, number[]>()
  let reference: number[] | undefined
  let same = true
  // Warm-up, every configuration: each service then holds the prompt as a kept prefix, so no rep
  // (in particular the first) times some configurations' full prefills and not others'.
  for (const c of configs) await measure(c.svc, PROMPT)
  for (const c of configs) c.counts.length = 0
  for (let r = 0; r < REPS; r++) {
    // Each rep starts with the next configuration: none is always first (after the previous rep's
    // last one) or always last.
    for (const c of [...configs.slice(r % configs.length), ...configs.slice(0, r % configs.length)]) {
      const m = await measure(c.svc, PROMPT)
      reference ??= m.tokens
      if (m.tokens.join() !== reference.join()) { same = false; process.stdout.write(`  ${c.label}: tokens differ from plain!\n`) }
      results.set(c.label, [...(results.get(c.label) ?? []), m.tokS])
      cpuMs.set(c.label, [...(cpuMs.get(c.label) ?? []), m.cpuMsPerToken])
    }
  }
  const base = lowerMedian(results.get('plain')!)
  const cpuBase = lowerMedian(cpuMs.get('plain')!)
  process.stdout.write(`\n| config | decode tok/s (median of ${REPS}) | speed-up | acceptance | tokens/round | K (mean) | verify rounds / request | CPU ms / token (median) | CPU × plain |\n|---|---|---|---|---|---|---|---|---|\n`)
  for (const c of configs) {
    const t = lowerMedian(results.get(c.label)!)
    const d = c.counts.reduce((a, x) => a + x.drafted, 0)
    const acc = c.counts.reduce((a, x) => a + x.accepted, 0)
    const rounds = c.counts.reduce((a, x) => a + x.rounds, 0)
    const steps = rounds + c.counts.reduce((a, x) => a + x.plainSteps, 0)
    const tokens = c.counts.length * (TOKENS - 1)
    process.stdout.write(`| ${c.label} | ${t.toFixed(1)} | ${(t / base).toFixed(2)}× | ${c.label === 'plain' ? '—' : d === 0 ? 'n/a' : `${(100 * acc / d).toFixed(1)} %`} | ${c.label === 'plain' ? '1' : steps === 0 ? '—' : (tokens / steps).toFixed(2)} | ${c.label === 'plain' ? '0' : rounds === 0 ? '0' : (d / rounds).toFixed(1)} | ${c.label === 'plain' ? '—' : (rounds / c.counts.length).toFixed(1)} | ${lowerMedian(cpuMs.get(c.label)!).toFixed(1)} | ${(lowerMedian(cpuMs.get(c.label)!) / cpuBase).toFixed(2)}× |\n`)
  }
  process.stdout.write(`\ntokens identical to plain decoding in every rep: ${same}\n`)
  if (copyTask) process.stdout.write(`plain tokens follow the cycle: ${reference!.join() === COPY_PROMPT.continuation(TOKENS).join()}\n`)
  process.stdout.write(`load at the end: ${loadAverage()}\n`)
  for (const c of configs) await c.svc.stop()
}

await main()
