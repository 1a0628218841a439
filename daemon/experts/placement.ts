/**
 * Expert placement: which holder nodes keep which experts of a mixture-of-experts model, decided
 * from the memory the nodes gossip (caps `memory.freeBytes`) and a routing histogram (rows each
 * expert received in a recent window). Pure: plain data in, a plan or a reason out.
 *
 * The rule, in order:
 * 1. Load. An expert's load is its share of its layer's routed rows, histogram counts + 1 (an
 *    expert nobody has chosen yet still gets a little), so every layer's loads sum to 1 and the
 *    whole model's to the number of MoE layers. No histogram: uniform.
 * 2. Copies. Every expert needs one; experts are equally large, so placement fails only when the
 *    nodes' free memory, counted in whole experts, is below the expert count: 'unplaceable'. Hot
 *    experts (load ≥ hotFactor × the layer mean) get extra copies, hottest first, up to
 *    maxReplicas, while slots remain beyond one copy of everything; a hot expert's rows are split
 *    evenly between its copies. Cold experts keep one copy. A copy is also what a request falls
 *    back to when a holder dies.
 * 3. Nodes. Every copy, heaviest first, goes to the node with the least load so far that has room
 *    and does not hold that expert yet (ties: more room left, then peer id) — the
 *    longest-processing-time rule, so node loads end within one copy's load of each other
 *    wherever memory does not bind, and cold experts fill (pack) whatever room the hot ones left.
 */

export interface PlacementNode {
  peerId: string
  /** Memory the node offers for experts (its gossiped free memory less what it keeps back). */
  freeBytes: number
}

export interface PlacementInput {
  /** Global indices of the MoE layers (ShardManifest.shape.moe.moeLayers). */
  moeLayers: number[]
  numExperts: number
  /** Resident size of one expert (all experts of a model are the same size): expertBytes(). */
  expertBytes: number
  nodes: PlacementNode[]
  /** histogram[i][e]: rows routed to expert e of layer moeLayers[i] in a recent window. */
  histogram?: number[][]
  /** An expert is hot at load ≥ hotFactor / numExperts (default 2: twice its fair share). */
  hotFactor?: number
  /** Most copies of a hot expert (default 2). */
  maxReplicas?: number
}

export interface LayerPlacement {
  layer: number
  /** holders[e]: the peers holding expert e, the first one primary. */
  holders: string[][]
  /** load[e]: the expert's share of its layer's rows (step 1 above). */
  load: number[]
}

export interface NodePlacement {
  peerId: string
  experts: number
  bytes: number
  /** Expected share of all routed rows this node computes (replicated experts split evenly). */
  load: number
}

export interface ExpertPlan {
  expertBytes: number
  layers: LayerPlacement[]
  /** Every input node, by peer id; a node given nothing has experts 0. */
  nodes: NodePlacement[]
}

export type PlacementDecision =
  | { kind: 'plan', plan: ExpertPlan }
  | { kind: 'unplaceable', reason: string, neededBytes: number, freeBytes: number }

export const DEFAULT_HOT_FACTOR = 2
export const DEFAULT_MAX_REPLICAS = 2

interface Slot { peerId: string, room: number, load: number, experts: number }

export function placeExperts (input: PlacementInput): PlacementDecision {
  const { moeLayers, numExperts: E, expertBytes } = input
  const hotFactor = input.hotFactor ?? DEFAULT_HOT_FACTOR
  const maxReplicas = Math.max(1, input.maxReplicas ?? DEFAULT_MAX_REPLICAS)
  if (!Number.isInteger(E) || E <= 0 || !(expertBytes > 0)) throw new RangeError('placeExperts: numExperts and expertBytes must be positive')
  if (input.histogram !== undefined && (input.histogram.length !== moeLayers.length || input.histogram.some(h => h.length !== E))) {
    throw new RangeError('placeExperts: histogram must have one row of numExperts counts per MoE layer')
  }
  const loads = moeLayers.map((_, i) => {
    const counts = input.histogram?.[i] ?? new Array<number>(E).fill(0)
    const smoothed = counts.map(c => Math.max(0, c) + 1)
    const total = smoothed.reduce((a, b) => a + b, 0)
    return smoothed.map(c => c / total)
  })
  const nodes: Slot[] = [...input.nodes]
    .sort((a, b) => (a.peerId < b.peerId ? -1 : a.peerId > b.peerId ? 1 : 0))
    .map(n => ({ peerId: n.peerId, room: Math.max(0, n.freeBytes), load: 0, experts: 0 }))
  const need = moeLayers.length * E
  const slots = nodes.reduce((s, n) => s + Math.floor(n.room / expertBytes), 0)
  const freeBytes = nodes.reduce((s, n) => s + n.room, 0)
  if (slots < need) {
    return { kind: 'unplaceable', reason: `${need} experts of ${expertBytes} bytes need ${need * expertBytes} bytes; the ${nodes.length} nodes hold ${slots} experts (${freeBytes} bytes free)`, neededBytes: need * expertBytes, freeBytes }
  }

  // Hot experts get extra copies, hottest first, while there is memory for them beyond one copy
  // of everything (ties by layer, then expert: the order, and so the plan, is deterministic).
  const order = moeLayers.flatMap((_, i) => loads[i]!.map((load, e) => ({ i, e, load })))
    .sort((a, b) => b.load - a.load || a.i - b.i || a.e - b.e)
  const copies = moeLayers.map(() => new Array<number>(E).fill(1))
  let spare = slots - need
  const hotAt = hotFactor / E
  for (let copy = 2; copy <= Math.min(maxReplicas, nodes.length); copy++) {
    for (const { i, e, load } of order) {
      if (load < hotAt - 1e-12 || spare === 0) break
      copies[i]![e] = copy
      spare--
    }
  }
  // Then every copy, heaviest first (a copy carries its expert's load / copies), each on the
  // least-loaded node with room that does not hold that expert yet (ties: more room, then peer id).
  const units = order.flatMap(({ i, e, load }) => Array.from({ length: copies[i]![e]! }, (_, c) => ({ i, e, c, load: load / copies[i]![e]! })))
    .sort((a, b) => b.load - a.load || a.i - b.i || a.e - b.e || a.c - b.c)
  const holders = moeLayers.map(() => Array.from({ length: E }, () => [] as Slot[]))
  for (const u of units) {
    const hs = holders[u.i]![u.e]!
    let pick: Slot | undefined
    for (const n of nodes) {
      if (n.room < expertBytes || hs.includes(n)) continue
      // Loads compare within a tolerance, so float rounding never decides between nodes.
      if (pick === undefined || n.load < pick.load - 1e-12 || (Math.abs(n.load - pick.load) <= 1e-12 && n.room > pick.room)) pick = n
    }
    // Only an extra copy can find no node (the room left is all on nodes that hold it): every
    // placed copy takes one of the slots counted above, and there are enough for the first copies.
    if (pick === undefined) continue
    pick.load += u.load
    pick.room -= expertBytes
    pick.experts++
    hs.push(pick)
  }
  // Final loads from the final holders (a dropped extra copy leaves its share to the others).
  for (const n of nodes) n.load = 0
  holders.forEach((layer, i) => layer.forEach((hs, e) => { for (const h of hs) h.load += loads[i]![e]! / hs.length }))
  return {
    kind: 'plan',
    plan: {
      expertBytes,
      layers: moeLayers.map((layer, i) => ({ layer, holders: holders[i]!.map(hs => hs.map(h => h.peerId)), load: loads[i]! })),
      nodes: nodes.map(n => ({ peerId: n.peerId, experts: n.experts, bytes: n.experts * expertBytes, load: n.load })),
    },
  }
}
