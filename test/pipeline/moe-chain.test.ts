/**
 * Mixture-of-experts models served the paper's way, whole layers per stage, through today's
 * daemon parts unchanged: the whole model in a StageEngine, and 2- and 3-stage chains over real
 * libp2p nodes on loopback, with concurrent requests of different lengths batched at every stage.
 * Every request's greedy tokens equal the float64 reference's (test/support/reference.ts).
 */
import { mkdtemp, rm } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { createChainTokenSource } from '../../daemon/pipeline/index.ts'
import { compileShards, generateTestModel, type MoeTestArchitecture, type ShardManifest } from '../../shards/index.ts'
import { encodePrompt } from '../shards/pipeline.ts'
import { ReferenceModel } from '../support/reference.ts'
import { chainFrom, holderOf, referenceTokens, runSource, startStage, startWholeEngine, stopHost, type StageHost } from './fixture.ts'

const N = 32
const TEXTS = ['The quick brown fox jumps over the lazy dog. Once upon a time', 'Once', 'A lazy dog and a quick brown fox']

describe.each(['qwen2-moe', 'mixtral'] as MoeTestArchitecture[])('%s', (arch) => {
  let root: string
  let manifest: ShardManifest
  let want: number[][]
  let prompts: number[][]

  beforeAll(async () => {
    root = await mkdtemp(join(tmpdir(), 'shoal-moe-chain-'))
    const ckpt = join(root, 'ckpt')
    await generateTestModel({ architecture: arch, outDir: ckpt, seed: 4 })
    prompts = await Promise.all(TEXTS.map(async t => await encodePrompt(ckpt, t)))
    const opts = { modelDir: ckpt, modelId: 'chain-test' }
    manifest = await compileShards({ ...opts, outDir: join(root, 'whole') })
    await compileShards({ ...opts, outDir: join(root, 'two'), stages: 2 })
    await compileShards({ ...opts, outDir: join(root, 'three'), layers: [[0, 1], [2, 2], [3, 3]] })
    want = prompts.map(p => new ReferenceModel(ckpt).greedy(p, N).tokens)
    expect(new Set(want[0]).size).toBeGreaterThan(6)
    expect(new Set(prompts.map(p => p.length)).size).toBe(3)
  }, 120_000)
  afterAll(async () => { await rm(root, { recursive: true, force: true }) })

  it('the whole model in one stage engine', async () => {
    const engine = await startWholeEngine({ root, whole: join(root, 'whole'), two: '', three: '', manifest, cleanup: async () => {} })
    try {
      for (const [i, p] of prompts.entries()) expect(await referenceTokens(engine, p, N)).toEqual(want[i])
    } finally {
      await engine.stop()
    }
  }, 120_000)

  it.each([
    { stages: 2, dir: 'two', ranges: [[0, 1], [2, 3]] as Array<[number, number]> },
    { stages: 3, dir: 'three', ranges: [[0, 1], [2, 2], [3, 3]] as Array<[number, number]> },
  ])('$stages-stage chain, concurrent requests', async ({ stages, dir, ranges }) => {
    const hosts: StageHost[] = []
    try {
      for (const r of ranges) hosts.push(await startStage(join(root, dir), r))
      const [coord, ...rest] = hosts
      const form = chainFrom(coord!, () => rest.map(h => holderOf(h)))
      const signal = AbortSignal.timeout(60_000)
      const got = await Promise.all(prompts.map(async (p, i) => {
        const src = createChainTokenSource({ node: coord!.stage.node, requestId: `moe-${stages}-${i}`, sampling: { temperature: 0, topP: 1 }, deadline: Date.now() + 60_000, formChain: form })
        try {
          return await runSource(src, p, N, signal)
        } finally {
          await src.close()
        }
      }))
      expect(got).toEqual(want)
    } finally {
      for (const h of hosts) await stopHost(h)
    }
  }, 120_000)
})
