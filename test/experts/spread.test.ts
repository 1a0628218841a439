/**
 * Experts spread over holder nodes: a MoE checkpoint compiled to expert-parallel shards runs with
 * the stage doing attention and the router and 1, 2 or 3 holders (placed by placeExperts) doing
 * the experts, every row crossing as /shoal/experts frames (encoded, decoded, answered by a real
 * holder with onnxruntime sessions). Greedy tokens equal the float64 reference's for single and
 * batched streams; a dead holder's replica takes over mid-sequence; with no replica the step fails
 * with a typed error instead of hanging. Bytes on the wire per decode token are reported.
 */
import { mkdtemp, rm } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { compileExpertShards, compileShards, generateTestModel, type ExpertShardLayout, type MoeTestArchitecture } from '../../shards/index.ts'
import { encodePrompt, greedyDecode, greedySplit, openPipeline } from '../shards/pipeline.ts'
import { ReferenceModel } from '../support/reference.ts'
import { linkTo, planFor, stageFor, startHolders } from './spread-stage.ts'

const N = 32
const TEXTS = ['The quick brown fox jumps over the lazy dog. Once upon a time', 'Once', 'A lazy dog and a quick brown fox']
describe.each(['qwen2-moe', 'mixtral'] as MoeTestArchitecture[])('%s with experts on holders', (arch) => {
  let root: string
  let dir: string
  let layout: ExpertShardLayout
  let prompts: number[][]
  let want: number[][]

  beforeAll(async () => {
    root = await mkdtemp(join(tmpdir(), 'shoal-spread-'))
    const ckpt = join(root, 'ckpt')
    await generateTestModel({ architecture: arch, outDir: ckpt, seed: 4 })
    dir = join(root, 'experts')
    layout = await compileExpertShards({ modelDir: ckpt, outDir: dir })
    prompts = await Promise.all(TEXTS.map(async t => await encodePrompt(ckpt, t)))
    want = prompts.map(p => new ReferenceModel(ckpt).greedy(p, N).tokens)
    expect(new Set(want[0]).size).toBeGreaterThan(6)
  }, 120_000)
  afterAll(async () => { await rm(root, { recursive: true, force: true }) })

  it.each([1, 2, 3])('%i holder(s): single and batched streams match the float64 reference', async (n) => {
    const plan = planFor(layout, n)
    const holders = await startHolders(dir, layout, plan)
    const stage = stageFor(dir, layout, plan, linkTo(holders, new Set()))
    await stage.open()
    try {
      const single = await stage.greedy([prompts[0]!], N)
      expect(single.tokens).toEqual([want[0]])
      expect((await stage.greedy(prompts, N)).tokens).toEqual(want)
      const busy = [...holders.values()].filter(h => h.stats().steps > 0).length
      console.log(`${arch}, ${n} holder(s): ${single.decodeBytes.toFixed(0)} bytes on the wire per decode token (one stream; frames both ways), ${busy} holders used`)
      expect(busy).toBe(n)
    } finally {
      await stage.close()
      for (const h of holders.values()) await h.stop()
    }
  }, 120_000)

  it.each(['int8', 'int4'] as const)('%s experts on 2 holders give the tokens of the same quantization in one graph, up to a near tie', async (quant) => {
    const qdir = join(root, `experts-${quant}`)
    const qlayout = await compileExpertShards({ modelDir: join(root, 'ckpt'), outDir: qdir, quant })
    const whole = await compileShards({ modelDir: join(root, 'ckpt'), outDir: join(root, `whole-${quant}`), quant })
    const p = await openPipeline(join(root, `whole-${quant}`), whole)
    const one = await greedyDecode(p, prompts[0]!, N)
    await p.release()
    const plan = planFor(qlayout, 2)
    const holders = await startHolders(qdir, qlayout, plan)
    const stage = stageFor(qdir, qlayout, plan, linkTo(holders, new Set()))
    await stage.open()
    try {
      const got = await stage.greedy([prompts[0]!], N)
      // The holders' products see other row counts than the one graph's (and sum the experts in
      // another order), so their bits differ; the tokens may part only at a near tie: where the one
      // graph's best two logits are closer than the two computations' logits differ.
      const tokens = got.tokens[0]!
      const { at, diff, margin } = greedySplit({ tokens, logits: got.logits }, one)
      const agree = tokens.filter((t, i) => t === want[0]![i]).length
      console.log(`${arch} ${quant} (int8 activations) on 2 holders: ${at}/${N} tokens as the one graph${margin === undefined ? '' : ` (its margin there ${margin.toExponential(2)})`}, max |logit − one-graph ${quant}| ${diff.toExponential(2)} until then; greedy agreement with the fp32 reference ${agree}/${N}`)
      if (margin !== undefined) expect(margin).toBeLessThanOrEqual(2 * diff)
    } finally {
      await stage.close()
      for (const h of holders.values()) await h.stop()
    }
  }, 120_000)

  it('a holder dies mid-sequence: its replicas take over and the tokens do not change', async () => {
    // hotFactor 0: every expert is hot, so each has a copy on two of the three holders.
    const plan = planFor(layout, 3, { hotFactor: 0, maxReplicas: 2 })
    expect(plan.layers.every(l => l.holders.every(h => h.length === 2))).toBe(true)
    const holders = await startHolders(dir, layout, plan)
    const dead = new Set<string>()
    const stage = stageFor(dir, layout, plan, linkTo(holders, dead))
    await stage.open()
    try {
      let stepsAtDeath = 0
      const got = await stage.greedy(prompts, N, (i) => { if (i === 8) { dead.add('holder-1'); stepsAtDeath = holders.get('holder-1')!.stats().steps } })
      expect(got.tokens).toEqual(want)
      expect(stage.exclude.has('holder-1')).toBe(true)
      expect(holders.get('holder-1')!.stats().steps).toBe(stepsAtDeath)
    } finally {
      await stage.close()
      for (const h of holders.values()) await h.stop()
    }
  }, 120_000)

  it('a holder dies and no copy of an expert is left: the step fails cleanly with SHOAL_ERR_PEER_LOST', async () => {
    const plan = planFor(layout, 2, { maxReplicas: 1 })
    const holders = await startHolders(dir, layout, plan)
    const dead = new Set<string>()
    const stage = stageFor(dir, layout, plan, linkTo(holders, dead))
    await stage.open()
    try {
      const err = await stage.greedy([prompts[0]!], N, (i) => { if (i === 3) dead.add('holder-0') }).catch((e: unknown) => e)
      expect((err as { code?: string }).code).toBe('SHOAL_ERR_PEER_LOST')
      expect((err as { name?: string }).name).toBe('ExpertsLostError')
    } finally {
      await stage.close()
      for (const h of holders.values()) await h.stop()
    }
  }, 120_000)
})
