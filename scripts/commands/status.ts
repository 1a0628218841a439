/** `shoal status`: the mesh as one node sees it, from that node's GET /v1/mesh. */
import { ExitError } from '../exit-error.ts'

interface MeshPeer {
  peerId: string
  name?: string
  admitted?: boolean
  reason?: string
  state?: string
  models?: Array<{ id: string, layers?: [number, number] | string }>
  load?: Record<string, unknown>
  rttMs?: number
  certificateExpiresAt?: string
  certificateExpiresSoon?: boolean
}

/** /v1/mesh `experts` (daemon/node/experts.ts ExpertsView): plans of the MoE models staged on the node, experts it holds. */
interface ExpertsSnapshot {
  plans?: Array<{
    model: string
    key?: string
    layers: Array<{ layer: number, holders: Record<string, number[]> }>
    nodes?: Array<{ peerId: string }>
    excluded?: string[]
    steps?: number
    bytesOut?: number
    bytesIn?: number
  }>
  holding?: { model: string, budgetBytes?: number, resident?: Array<{ layer: number, experts: number[] }>, steps?: number }
}

interface MeshSnapshot {
  self?: MeshPeer & Record<string, unknown>
  peers?: MeshPeer[]
  experts?: ExpertsSnapshot
}

function formatModels (models: MeshPeer['models']): string {
  if (models === undefined || models.length === 0) return '-'
  return models.map(m => m.layers === undefined ? m.id : `${m.id}@${Array.isArray(m.layers) ? m.layers.join('-') : m.layers}`).join(' ')
}

function formatLoad (load: MeshPeer['load']): string {
  if (load === undefined) return '-'
  const q = load.queueDepth ?? load.queue_depth
  const f = load.inFlight ?? load.in_flight
  const t = load.decodeTokPerSec ?? load.decodeTokensPerSecond
  return `q=${String(q ?? '?')} inflight=${String(f ?? '?')} tok/s=${typeof t === 'number' ? t.toFixed(1) : '?'}`
}

/** Admission first; liveness only when it is not plain 'alive' (a suspect peer is still admitted). */
function admission (p: MeshPeer): string {
  if (p.admitted === false) return `refused (${p.reason ?? '?'})`
  return p.state === undefined || p.state === 'alive' ? 'admitted' : `admitted, ${p.state}`
}

const mib = (bytes: number): string => `${(bytes / (1024 * 1024)).toFixed(1)} MiB`

function table (rows: string[][]): string[] {
  const widths = rows[0]!.map((_, i) => Math.max(...rows.map(r => (r[i] ?? '').length)))
  return rows.map(r => r.map((c, i) => c.padEnd(widths[i]!)).join('  ').trimEnd())
}

/**
 * The expert plans compactly: per staged MoE model, one row per holder with how many experts it
 * holds of each MoE layer (the expert ids are in /v1/mesh), and what this node holds itself.
 */
export function renderExperts (experts: ExpertsSnapshot | undefined, nameOf: (peerId: string) => string | undefined): string[] {
  if (experts === undefined) return []
  const out: string[] = []
  for (const plan of experts.plans ?? []) {
    const layers = [...plan.layers].sort((a, b) => a.layer - b.layer)
    const holders = [...new Set([...(plan.nodes ?? []).map(n => n.peerId), ...layers.flatMap(l => Object.keys(l.holders))])]
    const excluded = new Set(plan.excluded ?? [])
    const traffic = plan.steps === undefined ? '' : `; ${plan.steps} steps, ${mib(plan.bytesOut ?? 0)} out, ${mib(plan.bytesIn ?? 0)} in`
    out.push('', `experts of ${plan.model}${plan.key === undefined ? '' : ` (key ${plan.key.slice(0, 12)}…)`}: ${holders.length} holders, ${layers.length} MoE layers${traffic}`)
    const rows: string[][] = [['  HOLDER', 'PEER ID', ...layers.map(l => `L${l.layer}`), 'TOTAL']]
    for (const peerId of holders) {
      const counts = layers.map(l => l.holders[peerId]?.length ?? 0)
      rows.push([`  ${nameOf(peerId) ?? '-'}`, peerId, ...counts.map(String), String(counts.reduce((a, b) => a + b, 0))])
    }
    // Copies per expert, the weakest layer first: 1 means a holder's death re-places that expert.
    const copies = layers.map(l => {
      const per = new Map<number, number>()
      for (const es of Object.values(l.holders)) for (const e of es) per.set(e, (per.get(e) ?? 0) + 1)
      return per.size === 0 ? 0 : Math.min(...per.values())
    })
    rows.push(['  (min copies)', '', ...copies.map(String), ''])
    out.push(...table(rows))
    if (excluded.size > 0) out.push(`  excluded after failing a step: ${[...excluded].map(p => nameOf(p) ?? p).join(', ')}`)
  }
  const h = experts.holding
  if (h !== undefined) {
    const resident = h.resident ?? []
    const n = resident.reduce((a, l) => a + l.experts.length, 0)
    const per = resident.map(l => `L${l.layer}:${l.experts.length}`).join(' ')
    out.push('', `holding ${n} experts of ${h.model}${h.budgetBytes === undefined ? '' : ` (budget ${mib(h.budgetBytes)})`}${per === '' ? '' : `: ${per}`}${h.steps === undefined ? '' : `; ${h.steps} steps answered`}`)
  }
  return out
}

export function renderStatus (snapshot: MeshSnapshot): string {
  const rows: string[][] = [['', 'NAME', 'PEER ID', 'ADMISSION', 'MODELS', 'LOAD', 'RTT']]
  const row = (p: MeshPeer, self: boolean): string[] => [
    self ? '*' : '',
    p.name ?? '-',
    p.peerId,
    admission(p),
    formatModels(p.models),
    formatLoad(p.load),
    p.rttMs === undefined ? '-' : `${p.rttMs.toFixed(1)}ms`,
  ]
  if (snapshot.self !== undefined) rows.push(row(snapshot.self, true))
  for (const p of snapshot.peers ?? []) rows.push(row(p, false))
  const lines = table(rows)
  const names = new Map([snapshot.self, ...(snapshot.peers ?? [])].flatMap(p => (p?.name === undefined ? [] : [[p.peerId, p.name] as [string, string]])))
  lines.push(...renderExperts(snapshot.experts, peerId => names.get(peerId)))
  const warnings = [snapshot.self, ...(snapshot.peers ?? [])]
    .filter((p): p is MeshPeer => p !== undefined && p.certificateExpiresSoon === true)
    .map(p => `warning: the certificate of ${p.name ?? p.peerId} expires ${p.certificateExpiresAt ?? 'soon'}; issue a new one (shoal ca issue)`)
  return [...lines, ...warnings].join('\n')
}

export async function status (opts: { api: string }): Promise<void> {
  let base: URL
  try {
    base = new URL(/^https?:\/\//.test(opts.api) ? opts.api : `http://${opts.api}`)
  } catch {
    throw new ExitError(`--api: not a URL: ${opts.api}`)
  }
  let res: Response
  try {
    // A node with --require-keys wants a client key: SHOAL_API_KEY (a `shoal ca key` token), as OpenAI's clients read theirs.
    const key = process.env.SHOAL_API_KEY
    res = await fetch(new URL('/v1/mesh', base), { signal: AbortSignal.timeout(5000), ...(key === undefined || key === '' ? {} : { headers: { authorization: `Bearer ${key}` } }) })
  } catch (err) {
    throw new ExitError(`cannot reach ${base.origin}: ${(err as Error).message}`, 1)
  }
  if (res.status === 404) throw new ExitError(`${base.origin} runs no mesh (shoal serve has none); try a shoal node's API`, 1)
  if (res.status === 401) throw new ExitError(`${base.origin} requires a client key: set SHOAL_API_KEY to one from \`shoal ca key\``, 1)
  if (!res.ok) throw new ExitError(`${base.origin}/v1/mesh answered ${res.status}`, 1)
  process.stdout.write(renderStatus(await res.json() as MeshSnapshot) + '\n')
}
