// Live updates by server-sent events, and relative times. No build step, no framework.
"use strict";

function rel(ms) {
  var s = Math.round((Date.now() - ms) / 1000), f = s < 0, a = Math.abs(s), t;
  if (a < 120) t = a + "s"; else if (a < 7200) t = Math.floor(a / 60) + "m";
  else if (a < 172800) t = Math.floor(a / 3600) + "h"; else t = Math.floor(a / 86400) + "d";
  return f ? "in " + t : t + " ago";
}
function span(ms) {
  var s = Math.max(0, Date.now() - ms) / 1000;
  return s < 120 ? s.toFixed(1) + " s…" : Math.floor(s / 60) + " min " + Math.floor(s % 60) + " s…";
}
function tick(root) {
  (root || document).querySelectorAll("time[data-ago]").forEach(function (el) {
    el.textContent = rel(Number(el.dataset.ago));
  });
  (root || document).querySelectorAll("[data-since]").forEach(function (el) {
    el.textContent = span(Number(el.dataset.since));
  });
}
function bars(root) {
  // The steps' timeline: each bar from its start to its end on the run's time axis. The
  // server sends times, not positions, so a running step's bar grows here each second
  // without a new fragment (and the CSP allows no inline styles anyway).
  (root || document).querySelectorAll("table.steps[data-t0]").forEach(function (table) {
    var t0 = Number(table.dataset.t0), t1 = Number(table.dataset.t1), now = Date.now();
    var live = table.dataset.live === "1";
    if (live) t1 = Math.max(t1, now);
    var span = Math.max(t1 - t0, 1);
    table.querySelectorAll(".seg[data-s]").forEach(function (el) {
      var s = Number(el.dataset.s), e = el.dataset.e ? Number(el.dataset.e) : (live ? now : t1);
      el.style.left = Math.max(0, (s - t0) / span * 100) + "%";
      el.style.width = Math.max((e - s) / span * 100, 0.6) + "%";
    });
  });
}
function busy(box) {
  // Someone is typing or choosing in this part of the page: do not replace it under them.
  var a = document.activeElement;
  if (a && box.contains(a) && (a.tagName === "INPUT" || a.tagName === "TEXTAREA" || a.tagName === "SELECT")) return true;
  if (box.querySelector("input.pick:checked")) return true;  // runs ticked for the batch bar
  return Array.prototype.some.call(box.querySelectorAll("input[type=text], input:not([type]), textarea"), function (i) { return i.value !== i.defaultValue; });
}

function livePage() {
  var main = document.querySelector("main[data-live]"), box = document.getElementById("live");
  if (!main || !box || !window.EventSource) return;
  var es = new EventSource(main.dataset.live), pending = null;
  es.addEventListener("refresh", function (e) {
    if (busy(box)) { pending = e.data; return; }
    box.innerHTML = e.data; tick(box); bars(box);
    document.body.dataset.liveAt = String(Date.now());
  });
  document.addEventListener("focusout", function () {
    setTimeout(function () {
      if (pending !== null && !busy(box)) { box.innerHTML = pending; pending = null; tick(box); bars(box); }
    }, 50);
  });
}

function liveOutput() {
  var list = document.getElementById("output");
  if (!list || !window.EventSource || list.dataset.done) return;
  var state = document.getElementById("output-state");
  var es = new EventSource(list.dataset.stream);
  es.addEventListener("line", function (e) {
    var d = JSON.parse(e.data);
    var li = document.createElement("li"), t = document.createElement("time"), s = document.createElement("span");
    li.className = "t-" + d.type; t.textContent = d.at; s.textContent = d.text;  // text, never markup
    li.appendChild(t); li.appendChild(s);
    var atEnd = list.scrollTop + list.clientHeight >= list.scrollHeight - 8;
    list.appendChild(li);
    if (atEnd) list.scrollTop = list.scrollHeight;
  });
  es.addEventListener("final", function () {
    es.close(); if (state) state.textContent = "finished";
  });
  es.addEventListener("problem", function (e) { if (state) state.textContent = "problem: " + e.data; });
}

document.addEventListener("DOMContentLoaded", function () {
  tick(); bars(); livePage(); liveOutput();
  setInterval(function () { tick(); bars(); }, 1000);
  var out = document.getElementById("output");
  if (out) out.scrollTop = out.scrollHeight;
});
