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

interface MeshSnapshot {
  self?: MeshPeer & Record<string, unknown>
  peers?: MeshPeer[]
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
  const widths = rows[0]!.map((_, i) => Math.max(...rows.map(r => r[i]!.length)))
  const lines = rows.map(r => r.map((c, i) => c.padEnd(widths[i]!)).join('  ').trimEnd())
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
