/**
 * Speculative decoding on one node: single-stream greedy decode tok/s of a target model plain vs
 * with a draft model (K swept, and adaptive) and with prompt lookup, measured side by side in one
 * process, reps alternating between configurations. The pair comes from generateDraftPair: the
 * draft is the target's first layer(s), the target adds layers whose output projections are
 * scaled by ε, so acceptance is tunable (random weights otherwise disagree on nearly every token).
 * Every configuration's tokens are checked equal to plain decoding's.
 *
 * Run: node reproduction/bench-speculative.ts [--size 250m] [--vocab 0] [--layers 24] [--draft-layers 1]
 *        [--epsilon 0.02] [--quant int4] [--tokens 128] [--reps 3] [--k 1,2,4,6,8,adaptive] [--lookup yes|no]
 * Models are generated and compiled once into .cache/bench/ and reused.
 */
import { existsSync } from 'node:fs'
import { cpus, loadavg } from 'node:os'
import { join, resolve } from 'node:path'
import { performance } from 'node:perf_hooks'
import { parseArgs } from 'node:util'
import { createLocalService } from '../daemon/engine/index.ts'
import type { LocalService } from '../daemon/engine/index.ts'
import { createSpeculation } from '../daemon/speculative/index.ts'
import type { SpeculationCounts } from '../daemon/speculative/index.ts'
import { compileShards, generateDraftPair } from '../shards/index.ts'
import type { TestModelSize } from '../shards/index.ts'

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
  },
})
const TOKENS = Number(args.tokens)
const REPS = Number(args.reps)
const draftLayers = Number(args['draft-layers'])
const quant = args.quant as 'none' | 'int4' | 'int8'
const name = `spec-${args.size}-v${args.vocab}-${draftLayers}+${Number(args.layers) - draftLayers}-e${args.epsilon}-${quant}`
const dir = resolve(import.meta.dirname, '..', '.cache', 'bench', name)
const PROMPT = 'The quick brown fox jumps over the lazy dog. Once upon a time, in a land far away, there lived'

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

interface Measured { tokS: number, tokens: number[] }

async function measure (svc: LocalService, text: string): Promise<Measured> {
  const tokens: number[] = []
  let first = 0
  for await (const e of svc.generate({
    requestId: `b${performance.now()}`, model: svc.models()[0]!.id, prompt: { kind: 'text', text }, maxTokens: TOKENS,
    sampling: { temperature: 0, topP: 1 }, stop: [], deadline: Date.now() + 600_000,
  }, new AbortController().signal)) {
    if (e.type === 'delta') { if (tokens.length === 0) first = performance.now(); tokens.push(...e.tokenIds) }
  }
  return { tokS: (tokens.length - 1) * 1000 / (performance.now() - first), tokens }
}

const median = (xs: number[]): number => { const s = [...xs].sort((a, b) => a - b); return s[Math.floor((s.length - 1) / 2)]! }

async function main (): Promise<void> {
  const { target, draft } = await prepare()
  process.stdout.write(`# ${name}: ${cpus().length} cores (${cpus()[0]?.model}), load ${loadavg().map(l => l.toFixed(1)).join(' ')}\n`)
  const configs: Array<{ label: string, svc: LocalService, counts: SpeculationCounts[] }> = []
  const plain = createLocalService({ shardDir: target })
  await plain.start()
  configs.push({ label: 'plain', svc: plain, counts: [] })
  const ks = args.k.split(',').map(k => k === 'adaptive' ? 'adaptive' as const : Number(k))
  for (const k of ks) {
    const counts: SpeculationCounts[] = []
    const svc = createLocalService({ shardDir: target, sourceWrapper: createSpeculation({ drafter: { draftDir: draft }, k, onRequestEnd: (_id, c) => counts.push(c) }) })
    await svc.start()
    configs.push({ label: `draft K=${k}`, svc, counts })
  }
  if (args.lookup !== 'no') {
    for (const k of [4, 'adaptive'] as const) {
      const counts: SpeculationCounts[] = []
      const svc = createLocalService({ shardDir: target, sourceWrapper: createSpeculation({ drafter: 'prompt-lookup', k, onRequestEnd: (_id, c) => counts.push(c) }) })
      await svc.start()
      configs.push({ label: `lookup K=${k}`, svc, counts })
    }
  }
  const results = new Map<string, number[]>()
  let reference: number[] | undefined
  let same = true
  await measure(plain, PROMPT) // warm-up
  for (let r = 0; r < REPS; r++) {
    for (const c of configs) {
      const m = await measure(c.svc, PROMPT)
      reference ??= m.tokens
      if (m.tokens.join() !== reference.join()) { same = false; process.stdout.write(`  ${c.label}: tokens differ from plain!\n`) }
      results.set(c.label, [...(results.get(c.label) ?? []), m.tokS])
    }
  }
  const base = median(results.get('plain')!)
  process.stdout.write(`\n| config | decode tok/s (median of ${REPS}) | speed-up | acceptance | tokens/round | K (mean) |\n|---|---|---|---|---|---|\n`)
  for (const c of configs) {
    const t = median(results.get(c.label)!)
    const d = c.counts.reduce((a, x) => a + x.drafted, 0)
    const acc = c.counts.reduce((a, x) => a + x.accepted, 0)
    const rounds = c.counts.reduce((a, x) => a + x.rounds, 0)
    const steps = rounds + c.counts.reduce((a, x) => a + x.plainSteps, 0)
    const tokens = c.counts.length * (TOKENS - 1)
    process.stdout.write(`| ${c.label} | ${t.toFixed(1)} | ${(t / base).toFixed(2)}× | ${c.label === 'plain' ? '—' : d === 0 ? 'n/a' : `${(100 * acc / d).toFixed(1)} %`} | ${c.label === 'plain' ? '1' : steps === 0 ? '—' : (tokens / steps).toFixed(2)} | ${c.label === 'plain' ? '0' : rounds === 0 ? '0' : (d / rounds).toFixed(1)} |\n`)
  }
  process.stdout.write(`\ntokens identical to plain decoding in every rep: ${same}\n`)
  for (const c of configs) await c.svc.stop()
}

await main()
