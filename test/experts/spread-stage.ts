/**
 * Test helpers: a stage (the reference runner, daemon/experts/runner.ts) over a link, holders
 * started from an expert plan, in-process links, and plans over named or counted holders.
 */
import {
  createExpertHolder, createExpertParallelRunner, expertBytes, placeExperts,
  type ExpertHolder, type ExpertLink, type ExpertParallelRunner, type ExpertPlan,
} from '../../daemon/experts/index.ts'
import type { ExpertShardLayout } from '../../shards/index.ts'

export const MODEL = 'manifest-hash-of-the-test-model'

/** The stage for tests: the reference runner over an in-process or libp2p link. */
/** `kernels`: shoal's kernel library its graphs load (absent: onnxruntime's kernels), as in startHolders. */
export function stageFor (dir: string, layout: ExpertShardLayout, plan: ExpertPlan, link: ExpertLink, kernels?: string): ExpertParallelRunner {
  return createExpertParallelRunner({ dir, layout, plan, model: MODEL, link, ...(kernels === undefined ? {} : { kernels }) })
}

export async function startHolders (dir: string, layout: ExpertShardLayout, plan: ExpertPlan, kernels?: string): Promise<Map<string, ExpertHolder>> {
  const holders = new Map<string, ExpertHolder>()
  for (const node of plan.nodes) {
    const experts = plan.layers.flatMap(l => l.holders.flatMap((hs, expert) => hs.includes(node.peerId) ? [{ layer: l.layer, expert }] : []))
    const h = createExpertHolder({ dir, layout, model: MODEL, experts, ...(kernels === undefined ? {} : { kernels }) })
    await h.start()
    holders.set(node.peerId, h)
  }
  return holders
}

/** In-process links: the frame's bytes go to the holder's handle(); a dead holder's link fails. */
export function linkTo (holders: Map<string, ExpertHolder>, dead: Set<string>): ExpertLink {
  return async (peerId, parts) => {
    if (dead.has(peerId)) throw Object.assign(new Error(`holder ${peerId} is gone`), { code: 'SHOAL_ERR_PEER_LOST' })
    return await holders.get(peerId)!.handle(Uint8Array.from(parts.flatMap(p => [...p])))
  }
}

export function planFor (layout: ExpertShardLayout, holders: number | string[], opts: { hotFactor?: number, maxReplicas?: number } = {}): ExpertPlan {
  const moe = layout.shape.moe!
  const bytes = expertBytes(layout.shape, { kind: 'none' })
  const d = placeExperts({
    moeLayers: moe.moeLayers, numExperts: moe.numExperts, expertBytes: bytes,
    nodes: (typeof holders === 'number' ? Array.from({ length: holders }, (_, i) => `holder-${i}`) : holders).map(peerId => ({ peerId, freeBytes: 1000 * bytes })), ...opts,
  })
  if (d.kind !== 'plan') throw new Error(d.reason)
  return d.plan
}
