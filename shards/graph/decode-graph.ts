/**
 * The one-position graph of an 'ort-contrib' stage: the stage graph with every layer's
 * one-position `If` replaced by its then-branch, inline (docs/engine-notes.md, wave 28).
 *
 * Why a second graph: onnxruntime runs an If at ~7 µs each (its subgraph's frame is set up every
 * run), 2–3.5 % of a small model's one-row decode step, and an If whose branch is the whole layer
 * stack costs more, not less (wave 27). A graph for one-position steps alone needs no If. It
 * computes exactly what the stage graph's then-branches compute — the same nodes on the same
 * inputs — so the engine may run it for any step the stage graph would have sent down those
 * branches (one position, a non-empty past buffer) and get the same bits.
 *
 * It is derived from the built stage graph, not built again: its initializers are the stage
 * graph's own, pointing into the same external data file, so it adds a graph file and no weights
 * to the shard.
 */
import onnxProto from 'onnx-proto'

type IGraphProto = onnxProto.onnx.IGraphProto
type INodeProto = onnxProto.onnx.INodeProto

/** The stage graph's one-position Ifs are named …/decode/If (shards/graph/attention.ts). */
export const DECODE_IF_SUFFIX = '/decode/If'

/**
 * `graph` with each one-position If inlined as its then-branch (its outputs renamed to the If's)
 * and every node that then feeds nothing (the If's condition) removed; inputs, outputs and
 * initializers as they were, less initializers nothing reads. Throws when the graph has no such If.
 */
export function inlineDecodeBranches (graph: IGraphProto): IGraphProto {
  const nodes: INodeProto[] = []
  let inlined = 0
  for (const node of graph.node ?? []) {
    if (node.opType !== 'If' || node.name?.endsWith(DECODE_IF_SUFFIX) !== true) { nodes.push(node); continue }
    const branch = node.attribute?.find(a => a.name === 'then_branch')?.g
    const outs = branch?.output?.map(o => o.name ?? '') ?? []
    if (branch === undefined || branch === null || outs.length !== node.output?.length) throw new Error(`${node.name}: no then_branch with ${node.output?.length ?? 0} outputs`)
    const rename = new Map(outs.map((o, i) => [o, node.output![i]!]))
    const produced = new Set<string>()
    for (const inner of branch.node ?? []) {
      const output = (inner.output ?? []).map(o => rename.get(o) ?? o)
      output.forEach(o => produced.add(o))
      nodes.push({ ...inner, input: (inner.input ?? []).map(i => rename.get(i) ?? i), output })
    }
    // A branch output that is an outer value, not one its nodes make: pass it through.
    outs.forEach((o, i) => {
      const to = node.output![i]!
      if (!produced.has(to)) nodes.push({ name: `${node.name}/${i}/Identity`, opType: 'Identity', domain: '', input: [o], output: [to] })
    })
    inlined++
  }
  if (inlined === 0) throw new Error('the graph has no one-position If to inline')
  const kept = liveNodes(nodes, (graph.output ?? []).map(o => o.name ?? ''))
  const read = new Set<string>()
  for (const n of kept) for (const i of inputsOf(n)) read.add(i)
  return { ...graph, node: kept, initializer: (graph.initializer ?? []).filter(t => read.has(t.name ?? '')) }
}

/** The nodes that contribute to `outputs`, in their order. */
function liveNodes (nodes: INodeProto[], outputs: string[]): INodeProto[] {
  const producer = new Map<string, INodeProto>()
  for (const n of nodes) for (const o of n.output ?? []) producer.set(o, n)
  const live = new Set<INodeProto>()
  const todo = [...outputs]
  for (let name = todo.pop(); name !== undefined; name = todo.pop()) {
    const n = producer.get(name)
    if (n === undefined || live.has(n)) continue
    live.add(n)
    todo.push(...inputsOf(n))
  }
  return nodes.filter(n => live.has(n))
}

/** A node's inputs, with the outer values its subgraphs read (an If's branches) among them. */
function inputsOf (n: INodeProto): string[] {
  const names = (n.input ?? []).filter(i => i !== '')
  for (const a of n.attribute ?? []) {
    for (const inner of a.g?.node ?? []) names.push(...inputsOf(inner))
  }
  return names
}
