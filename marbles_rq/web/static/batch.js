// The runs list's batch bar: tick runs (or every run the filter selects), then act on them.
// The ticked ids travel in one field (the form reader takes a few fields, not fifty).
(function () {
  function picks() { return Array.prototype.slice.call(document.querySelectorAll("#live input.pick")); }
  function show() {
    var form = document.getElementById("batch"), label = document.getElementById("picked");
    if (!form || !label) return;
    if (form.elements.scope.value === "all") return;
    var n = picks().filter(function (c) { return c.checked; }).length;
    label.textContent = n ? n + " selected" : "none selected";
    form.classList.toggle("active", n > 0);
  }
  document.addEventListener("change", function (e) {
    var t = e.target, form = document.getElementById("batch");
    if (!form || !t.classList) return;
    if (t.classList.contains("pick-all")) picks().forEach(function (c) { c.checked = t.checked; });
    if (t.classList.contains("pick") || t.classList.contains("pick-all")) {
      form.elements.scope.value = "ids";
      show();
    }
  });
  document.addEventListener("click", function (e) {
    var t = e.target, form = document.getElementById("batch");
    if (!form || t.id !== "pick-matching") return;
    picks().forEach(function (c) { c.checked = true; });
    var all = document.querySelector("#live input.pick-all");
    if (all) all.checked = true;
    form.elements.scope.value = "all";
    document.getElementById("picked").textContent = t.dataset.label;
    form.classList.add("active");
  });
  document.addEventListener("submit", function (e) {
    var form = e.target;
    if (form.id !== "batch") return;
    form.elements.ids.value = picks().filter(function (c) { return c.checked; })
      .map(function (c) { return c.value; }).join(" ");
  });
})();
