/**
 * /shoal/experts/2.0.0 over real libp2p nodes on loopback (TCP + noise + yamux): a stage node and
 * 2 or 3 holder nodes, one long-lived stream per holder. Greedy tokens equal the float64
 * reference's for batched streams; a holder killed mid-sequence (connections aborted, node
 * stopped) is replaced by its replicas without a token changing.
 */
import { mkdtemp, rm } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import type { Libp2p } from '@libp2p/interface'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { createExpertLinks, serveExperts } from '../../daemon/experts/index.ts'
import { compileExpertShards, generateTestModel, type ExpertShardLayout } from '../../shards/index.ts'
import { componentsOf, createNode } from '../pipeline/fixture.ts'
import { encodePrompt } from '../shards/pipeline.ts'
import { ReferenceModel } from '../support/reference.ts'
import { planFor, stageFor, startHolders } from './spread-stage.ts'

const N = 24
const TEXTS = ['The quick brown fox jumps over the lazy dog. Once upon a time', 'Once', 'A lazy dog and a quick brown fox']

let root: string
let dir: string
let layout: ExpertShardLayout
let prompts: number[][]
let want: number[][]

beforeAll(async () => {
  root = await mkdtemp(join(tmpdir(), 'shoal-experts-p2p-'))
  const ckpt = join(root, 'ckpt')
  await generateTestModel({ architecture: 'qwen3-moe', outDir: ckpt, seed: 4 })
  dir = join(root, 'experts')
  layout = await compileExpertShards({ modelDir: ckpt, outDir: dir })
  prompts = await Promise.all(TEXTS.map(async t => await encodePrompt(ckpt, t)))
  want = prompts.map(p => new ReferenceModel(ckpt).greedy(p, N).tokens)
}, 120_000)
afterAll(async () => { await rm(root, { recursive: true, force: true }) })

describe.each([2, 3])('%i holder nodes', (n) => {
  it('batched streams match the reference; a killed holder\'s replicas take over', async () => {
    const stageNode = await createNode()
    const holderNodes: Libp2p[] = []
    for (let i = 0; i < n; i++) holderNodes.push(await createNode())
    const ids = holderNodes.map(h => h.peerId.toString())
    const plan = planFor(layout, ids, { hotFactor: 0, maxReplicas: 2 })
    const holders = await startHolders(dir, layout, plan)
    const servers = await Promise.all(ids.map(async (id, i) => await serveExperts(holders.get(id)!, componentsOf(holderNodes[i]!))))
    const links = createExpertLinks(componentsOf(stageNode))
    const stage = stageFor(dir, layout, plan, links.link)
    await stage.open()
    try {
      expect((await stage.greedy(prompts, N)).tokens).toEqual(want)
      expect(links.streams()).toBe(n)
      const victim = holderNodes[n - 1]!
      const got = await stage.greedy(prompts, N, (i) => {
        if (i !== 6) return
        for (const c of victim.getConnections()) c.abort(new Error('killed by test'))
        void victim.stop()
      })
      expect(got.tokens).toEqual(want)
      expect(stage.exclude.has(victim.peerId.toString())).toBe(true)
    } finally {
      await stage.close()
      links.stop()
      for (const s of servers) await s.stop()
      for (const h of holders.values()) await h.stop()
      for (const node of [stageNode, ...holderNodes]) await node.stop()
    }
  }, 120_000)
})
