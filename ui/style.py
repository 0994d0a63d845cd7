"""The look of the page: theme, CSS and the header (presentation only)."""

from __future__ import annotations

import html

import gradio as gr

THEME = gr.themes.Soft(primary_hue="indigo", secondary_hue="sky", neutral_hue="slate",
                       radius_size="md", text_size="md")

CSS = """
.gradio-container { max-width: 1440px !important; margin: 0 auto !important; }
.wb-header { display: flex; align-items: center; justify-content: space-between; gap: 16px;
  padding: 18px 24px; border-radius: 14px; color: white; margin-bottom: 6px;
  background: linear-gradient(120deg, #312e81 0%, #4f46e5 55%, #0ea5e9 100%); }
.wb-header h1 { margin: 0; font-size: 1.6rem; font-weight: 700; color: white; letter-spacing: -0.01em; }
.wb-header p { margin: 4px 0 0 0; opacity: 0.88; font-size: 0.95rem; color: white; }
.wb-header .wb-root { font-family: ui-monospace, monospace; font-size: 0.8rem; background: rgba(255,255,255,0.16);
  padding: 6px 10px; border-radius: 8px; white-space: nowrap; overflow: hidden; text-overflow: ellipsis;
  max-width: 45%; }
.wb-status { padding: 8px 12px; border-radius: 8px; font-size: 0.9rem; line-height: 1.45;
  border: 1px solid transparent; }
.wb-ok { background: #ecfdf5; color: #065f46; border-color: #a7f3d0; }
.wb-error { background: #fef2f2; color: #991b1b; border-color: #fecaca; font-family: ui-monospace, monospace;
  font-size: 0.82rem; }
.wb-info { background: #eef2ff; color: #3730a3; border-color: #c7d2fe; }
.wb-warn { background: #fffbeb; color: #92400e; border-color: #fde68a; }
.wb-progress { position: relative; height: 26px; border-radius: 13px; background: #e2e8f0; overflow: hidden; }
.wb-progress-bar { height: 100%; background: linear-gradient(90deg, #6366f1, #0ea5e9); transition: width 0.6s; }
.wb-progress span { position: absolute; inset: 0; display: flex; align-items: center; justify-content: center;
  font-size: 0.85rem; font-weight: 600; color: #0f172a; }
.wb-hint { color: #64748b; font-size: 0.88rem; }
.wb-panel { border: 1px solid #e2e8f0; border-radius: 12px; padding: 12px !important; background: #f8fafc; }
.wb-inline-btn { align-self: flex-end !important; max-height: 42px; margin-bottom: 8px; }
.wb-sticky { position: sticky; top: 8px; align-self: flex-start; }
.wb-table th, .wb-table th * { word-break: keep-all !important; overflow-wrap: normal !important; }
.wb-table { max-width: 100%; overflow-x: auto !important; }  /* a narrow window scrolls the table, not the page */
@media (max-width: 640px) { .wb-header { flex-direction: column; align-items: flex-start; }
  .wb-header .wb-root { max-width: 100%; } }
.wb-sample { margin: 8px 0; }
.wb-sample-title { font-size: 0.82rem; color: #475569; font-weight: 600; }
.wb-sample-text { white-space: pre-wrap; word-break: break-word; font-size: 0.82rem; padding: 8px;
  border-radius: 8px; background: #f8fafc; border: 1px solid #e2e8f0; max-height: 320px; overflow-y: auto; }
.wb-trained { background: #bbf7d0; color: #064e3b; border-radius: 3px; }
.wb-masked { color: #94a3b8; }
footer { display: none !important; }
"""


def header(root: str) -> str:
    return (
        '<div class="wb-header"><div><h1>LoRA Workbench</h1>'
        "<p>Configure a fine-tuning recipe, check that it fits, launch it, watch it and compare it with earlier runs.</p>"
        f'</div><div class="wb-root" title="workspace root">workspace: {html.escape(root)}</div></div>'
    )
